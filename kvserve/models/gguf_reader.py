"""``gguf.GGUFReader`` with a faster metadata parse: the same parse, over a plain ndarray view of the
memory map. GGUFReader slices its ``np.memmap`` once per value, and every slice of a memmap subclass
runs ``memmap.__array_finalize__``; a GGUF tokenizer stores each of its tokens as separate values
(Gemma 3's 262,144-token vocabulary: ~1.5 M slices), which took 16 s to open, 2.8 s this way
(measured on this project's 2-core machine). Fields and tensors are the same arrays (still mapped,
not read).
"""
from __future__ import annotations

import numpy as np
from gguf import GGUFReader


class FastGGUFReader(GGUFReader):
    def _get(self, offset: int, dtype, count: int = 1, override_order=None) -> np.ndarray:
        """As ``GGUFReader._get``: ``count`` values of ``dtype`` at byte ``offset``, in file byte order."""
        data = self.data
        if type(data) is np.memmap:  # the first call, inside GGUFReader.__init__
            self.data = data = data.view(np.ndarray)  # same mapped buffer, no memmap bookkeeping
        dt = np.dtype(dtype)
        count = int(count)
        arr = data[offset:offset + dt.itemsize * count].view(dt)[:count]
        order = self.byte_order if override_order is None else override_order
        return arr if order == "I" else arr.view(arr.dtype.newbyteorder(order))
