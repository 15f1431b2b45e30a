"""``kvserve bench spec``: batch-1 decode speed with and without speculative decoding on a copy-heavy
workload (repeat or edit a passage) and on free chat, in one engine (requests opt out with
``SamplingParams(speculative=False)`` for the baseline), beside the speed-up Leviathan et al. 2023
predict from the measured acceptance rate and the measured cost of a verification step."""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.metrics.stats import mean
from kvserve.planner.spec_decode import expected_tokens_per_step
from kvserve.sampling_params import SamplingParams

PASSAGE = ("The paged KV cache stores keys and values in fixed-size blocks. Each request owns a block table "
           "that maps its token positions to blocks, so memory is allocated one block at a time and freed "
           "blocks return to a shared pool. Decoding streams every weight and the whole cache once per step.")
COPY_PROMPTS = [f"Repeat the following passage exactly, word for word:\n\n{PASSAGE}",
                f"Rewrite this passage with 'block' replaced by 'page', changing nothing else:\n\n{PASSAGE}",
                f"Copy this text verbatim:\n\n{PASSAGE}"]
CHAT_PROMPTS = ["What are three good habits for staying healthy?", "Explain what a compiler does.",
                "Write a short poem about the sea."]


@dataclass
class SpecRow:
    workload: str
    tokens_per_s_plain: float
    tokens_per_s_spec: float
    acceptance_rate: float
    mean_tokens_per_step: float
    verify_over_plain_step: float  # wall time of a verification step / a plain decode step
    predicted_speedup: float
    propose_over_plain_step: float = 0.0  # proposal time per verification step (a draft model's steps) / plain

    @property
    def speedup(self) -> float:
        return self.tokens_per_s_spec / self.tokens_per_s_plain


def _decode_rate(outs) -> float:
    """Output tokens after the first per second of decode time (E2E − TTFT), over all requests."""
    toks = sum(o.latency.num_output_tokens - 1 for o in outs)
    secs = sum((o.latency.e2e_ms - o.latency.ttft_ms) / 1e3 for o in outs)
    return toks / secs if secs else 0.0


def predicted_speedup(verify: float, propose: float, alpha: float, k: int, spec_share: float) -> float:
    """Decode speed-up Leviathan et al. 2023 predict: a verification step costs ``verify`` plain steps
    plus ``propose`` for making its ``k`` proposals (a draft model's steps; ~0 for n-gram lookup) and
    yields E[tokens] = (1 - α^(k+1)) / (1 - α) at acceptance ``alpha``; ``spec_share`` of the decode
    steps speculate, the rest cost one plain step per token."""
    per_token = (verify + propose) / expected_tokens_per_step(alpha, k)
    return 1.0 / ((1 - spec_share) + spec_share * per_token)


def run_workload(llm, name: str, prompts: list[str], max_tokens: int, k: int,
                 params: SamplingParams | None = None) -> SpecRow:
    """Each prompt at batch 1 without and with speculation (alternating), greedy or with ``params``'
    sampling settings (its max_tokens replaced by ``max_tokens``)."""
    eng = llm.engine
    sp = (params or SamplingParams(temperature=0)).clone(max_tokens=max_tokens)
    plain, spec = [], []
    stats0 = (eng.scheduler.spec_stats.num_draft_tokens, eng.scheduler.spec_stats.num_accepted_tokens,
              eng.scheduler.spec_stats.num_drafts)
    first, propose0 = eng.num_steps + 1, eng.propose_s
    for p in prompts:  # batch 1, alternating so both see the same machine state
        plain.append(llm.chat([{"role": "user", "content": p}], sp.clone(speculative=False))[0].outputs[0])
        spec.append(llm.chat([{"role": "user", "content": p}], sp)[0].outputs[0])
    s = eng.scheduler.spec_stats
    proposed, accepted, drafts = (s.num_draft_tokens - stats0[0], s.num_accepted_tokens - stats0[1],
                                  s.num_drafts - stats0[2])
    alpha = accepted / proposed if proposed else 0.0
    steps = [st for st in eng.step_stats if st.step >= first and st.num_seqs == 1]
    plain_ms = mean([st.wall_s for st in steps if st.num_tokens == 1]) or 1.0
    verify_ms = mean([st.wall_s for st in steps if 1 < st.num_tokens <= k + 1]) or plain_ms
    ratio = verify_ms / plain_ms
    # the proposals are made outside the steps' wall time: a draft model's own steps cost per verification
    propose = (eng.propose_s - propose0) / drafts / plain_ms if drafts else 0.0
    # only steps that carried proposals speed up: the spec run's other decode steps made one token each
    spec_run_tokens = sum(o.latency.num_output_tokens - 1 for o in spec)
    plain_steps_in_spec_run = max(0, spec_run_tokens - (drafts + accepted))
    spec_steps = drafts / max(1, drafts + plain_steps_in_spec_run)
    predicted = predicted_speedup(ratio, propose, alpha, k, spec_steps) if drafts else 1.0
    return SpecRow(name, _decode_rate(plain), _decode_rate(spec), alpha, 1 + accepted / drafts if drafts else 1.0,
                   ratio, predicted, propose)


def sampling_label(params: SamplingParams | None) -> str:
    """"greedy", or the sampling settings that are on (e.g. "temperature 0.8, top-p 0.9, seed 0")."""
    if params is None or params.greedy:
        return "greedy"
    parts = [f"temperature {params.temperature:g}"]
    if params.top_p < 1:
        parts.append(f"top-p {params.top_p:g}")
    if params.min_p > 0:
        parts.append(f"min-p {params.min_p:g}")
    if params.seed is not None:
        parts.append(f"seed {params.seed}")
    return ", ".join(parts)


def format_spec(rows: list[SpecRow], k: int, method: str = "n-gram", params: SamplingParams | None = None) -> str:
    """The table; ``method`` names the speculation in the title ("n-gram", "draft model M"), ``params`` the
    sampling (None: greedy)."""
    lines = [f"kvserve bench spec — {method} speculation, k = {k}, batch 1, {sampling_label(params)}",
             f"{'workload':>10} {'tok/s off':>10} {'tok/s on':>9} {'speed-up':>9} {'accept':>7} {'tok/step':>9} "
             f"{'verify/plain':>13} {'propose/plain':>14} {'predicted':>10}"]
    for r in rows:
        lines.append(f"{r.workload:>10} {r.tokens_per_s_plain:>10.1f} {r.tokens_per_s_spec:>9.1f} {r.speedup:>8.2f}x "
                     f"{100 * r.acceptance_rate:>6.0f}% {r.mean_tokens_per_step:>9.2f} {r.verify_over_plain_step:>12.2f}x "
                     f"{r.propose_over_plain_step:>13.2f}x {r.predicted_speedup:>9.2f}x")
    lines.append("predicted = Leviathan et al. 2023: E[tokens/step] = (1 - a^(k+1)) / (1 - a) at the measured "
                 "acceptance a, divided by the measured cost of a verification step and of making its proposals "
                 "(propose: a draft model's steps; n-gram lookup nearly free), over the steps that speculated")
    return "\n".join(lines)
