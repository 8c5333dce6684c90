"""Prompt-lookup drafting (vLLM's "ngram" method): no weights, no forward.

The last n tokens of a request (n from prompt_lookup_max down to
prompt_lookup_min) are looked up among its earlier tokens, prompt and output;
the tokens that followed their latest earlier occurrence are the draft. It
pays where the output repeats the input (editing, quoting, code) or itself.

Each request keeps an index from every n-gram to where it last ended, grown
by the tokens committed since the last step (a step costs O(new tokens x the
n range), not a scan of the context).
"""
from __future__ import annotations

from shepherd.model.sampler import SamplingState


class NgramIndex:
    """A request's committed tokens and, per n, n-gram -> the end (exclusive) of its latest
    occurrence that ends before the last token."""
    __slots__ = ("toks", "ends", "indexed", "nmin", "nmax")

    def __init__(self, nmin: int, nmax: int):
        self.toks: list[int] = []
        self.ends = [dict() for _ in range(nmax + 1)]
        self.indexed = 0          # n-grams ending at 1 .. indexed are in `ends`
        self.nmin, self.nmax = nmin, nmax

    def sync(self, prompt: list[int], out: list[int], last: int) -> None:
        """Grow to prompt + out + [last] (a request's committed tokens only ever grow)."""
        toks = self.toks
        have = len(toks)
        np_ = len(prompt)
        if have < np_:
            toks.extend(prompt[have:])
            have = np_
        no = len(out)
        if have < np_ + no:
            toks.extend(out[have - np_:])
        toks.append(last)

    def propose(self, k: int) -> list[int]:
        toks = self.toks
        L = len(toks)
        ends = self.ends
        for e in range(self.indexed + 1, L):          # index the n-grams ending before the last token
            for n in range(self.nmin, min(self.nmax, e) + 1):
                ends[n][tuple(toks[e - n:e])] = e
        self.indexed = max(self.indexed, L - 1)
        for n in range(min(self.nmax, L), self.nmin - 1, -1):     # the longest suffix that occurred before
            e = ends[n].get(tuple(toks[L - n:]))
            if e is not None:
                return toks[e:e + k]
        return []


class NgramDrafter:
    def __init__(self, nmin: int, nmax: int):
        self.nmin, self.nmax = nmin, nmax
        self.index: dict[str, NgramIndex] = {}

    def propose(self, items: list[tuple[str, SamplingState, int, int]]) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for rid, st, last, k in items:
            ix = self.index.get(rid)
            committed = len(st.prompt_ids) + len(st.output_ids) + 1
            if ix is None or len(ix.toks) >= committed:      # new, or rolled back (never in practice): rebuild
                ix = self.index[rid] = NgramIndex(self.nmin, self.nmax)
            ix.sync(st.prompt_ids, st.output_ids, last)
            d = ix.propose(k)
            if d:
                out[rid] = d
        return out

    def forget(self, req_id: str) -> None:
        self.index.pop(req_id, None)
