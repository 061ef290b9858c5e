"""Sampling: llama.cpp's sampler chain (``llama_sampler_*``) plus stop-string handling.

The chain mirrors llama-cpp-python's ``Llama._init_sampler`` so a seeded run matches it:
penalties (last 64 tokens) → greedy when ``temperature <= 0``, otherwise top-k → top-p →
min-p → temperature → dist(seed). Stop strings work on decoded text: text that might be the
start of a stop string is held back until it is known not to be.
"""
from __future__ import annotations

import codecs
import re
from dataclasses import dataclass, field

from runtime.engine.types import check_token_ids
from runtime.errors import UserError

PENALTY_LAST_N = 64          # tokens the repeat penalty looks back over (llama-cpp-python's)
DEFAULT_SEED = 0xFFFFFFFF    # LLAMA_DEFAULT_SEED: llama.cpp picks a random seed
MAX_TOP_LOGPROBS = 20        # OpenAI's limit on top_logprobs
TOKEN_DATA = [("id", "<i4"), ("logit", "<f4"), ("p", "<f4")]   # llama_token_data's layout
# llama.cpp's GBNF parser recurses once per "(" (about 450 bytes of C stack a level: 20000
# levels overflowed an 8 MiB thread stack and the process died of SIGSEGV)
MAX_GRAMMAR_NESTING = 1000
_GBNF_LITERAL = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]')


@dataclass
class SamplingParams:
    """How to pick tokens. ``seed=-1``: random; ``max_tokens<=0``: up to the context end."""

    max_tokens: int = 128
    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 40
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    seed: int = -1
    stop: list[str] = field(default_factory=list)
    frequency_penalty: float = 0.0     # OpenAI's, over the penalty window (0 = off)
    presence_penalty: float = 0.0
    grammar: str | None = None         # GBNF (root rule "root"): llama.cpp's grammar sampler
    logit_bias: dict[int, float] = field(default_factory=dict)   # token id -> added to logit
    logprobs: int | None = None        # None: off; k >= 0: each token's logprob + top k
    # logprobs of the candidates left after the sampler chain (llama-server's
    # post_sampling_probs) instead of the raw model's
    post_sampling: bool = False
    n_keep: int = 0                    # context shift: tokens kept at the start (-1: the prompt)
    ignore_eos: bool = False           # end-of-generation tokens never sampled (--ignore-eos)
    # this request's LoRA scales by adapter id (those not named: 0); None: the server's global
    # scales (runtime.engine.lora)
    lora: dict[int, float] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        problems = []
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            problems.append(f"logprobs={self.logprobs} must be in [0, {MAX_TOP_LOGPROBS}]")
        if self.grammar is not None and not self.grammar.strip():
            problems.append("grammar must not be empty")
        if not self.temperature >= 0:
            problems.append(f"temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            problems.append(f"top_k={self.top_k} must be >= 0 (0 = off)")
        if not 0 <= self.min_p <= 1:
            problems.append(f"min_p={self.min_p} must be in [0, 1]")
        if not self.repeat_penalty > 0:
            problems.append(f"repeat_penalty={self.repeat_penalty} must be > 0")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                problems.append(f"{name}={getattr(self, name)} must be in [-2, 2]")
        if problems:
            raise UserError("sampling: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    @property
    def chain_seed(self) -> int:
        return DEFAULT_SEED if self.seed < 0 else self.seed & 0xFFFFFFFF


class GrammarDeadEnd(UserError):
    """No token the sampler chain left can continue the grammar (the grammar asks for text
    the vocabulary cannot spell, or ``logit_bias`` removed every token it allows)."""


class Sampler:
    """A ``llama_sampler`` chain built from ``SamplingParams``; ``close()`` frees it.

    With a grammar, a token is checked against it before the chain accepts it: llama.cpp's
    grammar sampler throws a C++ exception (``Unexpected empty grammar stack``) or aborts
    (an end-of-generation token the grammar does not allow) when it accepts a token it
    rejects, and that happens when the chain leaves only rejected candidates (every logit
    -inf); through ctypes either ends the process. Such a token is a ``GrammarDeadEnd``."""

    def __init__(self, params: SamplingParams, n_vocab: int, vocab: int | None = None):
        """``vocab``: the model's ``llama_vocab *`` (needed by a grammar)."""
        from runtime.native.llama_lib import bindings  # noqa: PLC0415

        ll = self._ll = bindings()
        chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        self._chain = chain
        self._n_vocab = n_vocab
        self._grammar = None          # the chain's grammar sampler (owned by the chain)
        add = lambda s: ll.llama_sampler_chain_add(chain, s)  # noqa: E731
        add(ll.llama_sampler_init_penalties(n_vocab, PENALTY_LAST_N, params.repeat_penalty,
                                            params.frequency_penalty, params.presence_penalty))
        bias = dict(params.logit_bias)
        if params.ignore_eos and vocab is not None:   # llama.cpp: EOG tokens biased to -inf
            for token in (ll.llama_vocab_eos(vocab), ll.llama_vocab_eot(vocab)):
                if token >= 0:
                    bias[int(token)] = float("-inf")
        try:
            if bias:
                check_token_ids(bias, n_vocab, "logit_bias")
            if params.grammar is not None:
                check_grammar_nesting(params.grammar)
        except UserError:
            self.close()
            raise
        if bias:
            items = (ll.llama_logit_bias * len(bias))(
                *[ll.llama_logit_bias(int(t), float(b)) for t, b in bias.items()])
            add(ll.llama_sampler_init_logit_bias(n_vocab, len(bias), items))
        if params.grammar is not None:
            grammar = ll.llama_sampler_init_grammar(vocab, params.grammar.encode("utf-8"),
                                                    b"root")
            if not grammar:
                self.close()
                raise UserError("grammar: llama.cpp cannot parse it (GBNF with a 'root' rule)")
            add(grammar)
            self._grammar = grammar
        if params.greedy:
            add(ll.llama_sampler_init_greedy())
        else:
            add(ll.llama_sampler_init_top_k(params.top_k))
            add(ll.llama_sampler_init_top_p(params.top_p, 1))
            add(ll.llama_sampler_init_min_p(params.min_p, 1))
            add(ll.llama_sampler_init_temp(params.temperature))
            add(ll.llama_sampler_init_dist(params.chain_seed))

    def sample(self, ctx: int, idx: int = -1) -> int:
        """Pick a token from the logits of output ``idx`` (-1: the last) and accept it."""
        if self._grammar is None:
            return int(self._ll.llama_sampler_sample(self._chain, ctx, idx))
        import numpy as np  # noqa: PLC0415

        ptr = self._ll.llama_get_logits_ith(ctx, idx)
        if not ptr:
            raise RuntimeError(f"llama.cpp has no logits for output {idx}")
        return self._pick(np.ctypeslib.as_array(ptr, shape=(self._n_vocab,)))[0]

    def _accept(self, token: int) -> None:
        """Accept ``token`` into the chain; with a grammar, only a token the grammar allows
        (applied alone to a one-candidate array: -inf means rejected; apply changes no
        state), else ``GrammarDeadEnd``."""
        import ctypes  # noqa: PLC0415

        ll = self._ll
        if self._grammar is not None:
            one = ll.llama_token_data(token, 0.0, 0.0)
            cur = ll.llama_token_data_array(ctypes.pointer(one), 1, -1, False)
            ll.llama_sampler_apply(self._grammar, ctypes.byref(cur))
            if one.logit == float("-inf"):
                raise GrammarDeadEnd("grammar: no token can continue it (the vocabulary "
                                     "cannot spell what it asks for here, or logit_bias "
                                     "removed every token it allows)")
        ll.llama_sampler_accept(self._chain, token)

    def _pick(self, logits):
        """Apply the chain to ``logits`` ((n_vocab,) float32), accept the token it selects:
        (token, the candidates the chain left (TOKEN_DATA records), the selected index)."""
        import ctypes  # noqa: PLC0415

        import numpy as np  # noqa: PLC0415

        ll = self._ll
        n = int(logits.shape[0])
        data = (ll.llama_token_data * n)()
        view = np.frombuffer(data, dtype=TOKEN_DATA)          # (n_vocab,) shares data
        view["id"], view["logit"], view["p"] = np.arange(n), logits, 0.0
        cur = ll.llama_token_data_array(ctypes.cast(data, ctypes.POINTER(ll.llama_token_data)),
                                        n, -1, False)
        ll.llama_sampler_apply(self._chain, ctypes.byref(cur))
        left = np.frombuffer((ll.llama_token_data * cur.size).from_address(
            ctypes.addressof(cur.data.contents)), dtype=TOKEN_DATA)   # (size,) after the chain
        if not 0 <= cur.selected < cur.size:
            raise RuntimeError("llama.cpp's sampler chain selected no token")
        token = int(left["id"][cur.selected])
        self._accept(token)
        return token, left, int(cur.selected)

    def sample_candidates(self, logits,
                          k: int) -> tuple[int, float, list[tuple[int, float]]]:
        """Pick a token from ``logits`` ((n_vocab,) float32) as ``sample`` does (the same
        apply-then-accept steps, so a seeded chain picks the same tokens), and return the
        token's probability after the chain, and the candidates the chain left with theirs,
        the ``k`` most probable first. A greedy chain computes no distribution: as
        llama-server's greedy chain with n_probs (top-k n_probs, softmax, greedy), the ``k``
        highest logits share a softmax."""
        import numpy as np  # noqa: PLC0415

        token, left, selected = self._pick(logits)
        if not left["p"].any():                # greedy: no distribution was computed
            best = np.argsort(-left["logit"], kind="stable")[:max(k, 1)]
            weights = np.exp(left["logit"][best].astype(np.float64) - left["logit"][best[0]])
            probs = weights / weights.sum()
            top = [(int(left["id"][i]), float(p)) for i, p in zip(best, probs)]
            return token, dict(top).get(token, float(probs[0])), top
        order = np.argsort(-left["p"], kind="stable")[:max(k, 1)]
        return token, float(left["p"][selected]), [
            (int(left["id"][i]), float(left["p"][i])) for i in order if left["p"][i] > 0]

    def close(self) -> None:
        if self._chain:
            self._ll.llama_sampler_free(self._chain)
            self._chain = None

    def __del__(self) -> None:
        self.close()


class TextStream:
    """Token bytes in, safe-to-show text out: completes UTF-8 sequences across tokens and
    holds back a tail that could begin a stop string."""

    def __init__(self, stop: list[str]):
        self.stop = list(stop)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="ignore")
        self._held = ""          # decoded, not yet shown
        self.stopped = False

    def feed(self, piece: bytes) -> str:
        """Add one token's bytes; return the text that can be shown now."""
        if self.stopped:
            return ""
        self._held += self._utf8.decode(piece)
        return self._release(final=False)

    def finish(self) -> str:
        """End of generation: return whatever is still held (never a stop string)."""
        if self.stopped:
            return ""
        self._held += self._utf8.decode(b"", final=True)
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        text = self._held
        hits = [(text.find(s), s) for s in self.stop if s in text]
        if hits:
            cut = min(pos for pos, _ in hits)
            self.stopped, self._held = True, ""
            return text[:cut]
        keep = 0 if final else self._partial_stop_len(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep]

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best


def outside_literals(grammar: str) -> str:
    """GBNF text with its quoted strings and character classes blanked (their braces and
    parentheses are characters, not syntax)."""
    return _GBNF_LITERAL.sub('""', grammar)


def check_grammar_nesting(grammar: str) -> None:
    """UserError when ``grammar`` nests groups deeper than llama.cpp's parser can recurse."""
    depth = deepest = 0
    for ch in outside_literals(grammar):
        if ch == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif ch == ")":
            depth -= 1
    if deepest > MAX_GRAMMAR_NESTING:
        raise UserError(f"grammar: groups nested {deepest} deep are over the limit of "
                        f"{MAX_GRAMMAR_NESTING} (llama.cpp's parser recurses per level)")


def check_grammar(vocab: int, grammar: str) -> None:
    """UserError unless llama.cpp's grammar sampler accepts ``grammar`` (built and freed)."""
    from runtime.native.llama_lib import bindings  # noqa: PLC0415

    check_grammar_nesting(grammar)
    ll = bindings()
    sampler = ll.llama_sampler_init_grammar(vocab, grammar.encode("utf-8"), b"root")
    if not sampler:
        raise UserError("grammar: llama.cpp cannot parse it (GBNF with a 'root' rule)")
    ll.llama_sampler_free(sampler)
