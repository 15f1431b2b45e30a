import pytest

from kvserve import LLM


def tiny_llm(**kw) -> LLM:
    """A 2-layer random-weight Llama (GQA 4/2 heads) with the SmolLM2 tokenizer."""
    kw.setdefault("max_model_len", 512)
    return LLM("tiny-llama", load_format="dummy", progress=False, **kw)


@pytest.fixture(scope="session")
def tiny():
    return tiny_llm()


@pytest.fixture(scope="session")
def smollm2():
    """The bundled real model (SmolLM2-135M-Instruct, Q4_1 GGUF dequantized to float32)."""
    return LLM("smollm2-135m", weight_dtype="float32", progress=False)


class ServerHandle:
    """A kvserve app served by uvicorn on a free loopback port in a background thread."""

    def __init__(self, llm, **app_kw):
        import socket
        import threading
        import time

        import uvicorn

        from kvserve.server.app import create_app

        self.app = create_app(llm, **app_kw)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.05)
        self.engine = llm.engine

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="session")
def tiny_server():
    """Tiny random-weight model behind the HTTP server (session-wide)."""
    h = ServerHandle(tiny_llm())
    yield h
    h.stop()
