"""A small SentencePiece-style ("llama") vocabulary and a ChatML template for synthetic models.

llama.cpp's SPM tokenizer splits text into UTF-8 characters, merges neighbouring pieces whose
concatenation is in the vocabulary (highest score first) and falls back to ``<0xNN>`` byte
tokens for anything else, so every string round-trips. The vocabulary here is: control tokens,
256 byte tokens, the printable ASCII characters, and every prefix of a few hundred common
English words (so whole words are reachable by successive merges). A preset pads it with unused
``[PADn]`` tokens to a real model's row count (``build_vocab(size)``), so token_embd and output
have the real shapes.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Iterator

# llama.cpp token types (llama_token_type in llama.h)
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

SPACE = "\u2581"  # SentencePiece's visible space, "▁"

UNK_ID = 0
BOS_ID = 1
EOS_ID = 2
IM_START_ID = 3
IM_END_ID = 4
_CONTROL = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WORDS = """
the of and to in is it you that he was for on are with as his they be at one have this from
or had by hot word but what some we can out other were all there when up use your how said
an each she which do their time if will way about many then them write would like so these her
long make thing see him two has look more day could go come did number sound no most people my
over know water than call first who may down side been now find any new work part take get place
made live where after back little only round man year came show every good me give our under
name very through just form sentence great think say help low line differ turn cause much mean
before move right boy old too same tell does set three want air well also play small end put
home read hand port large spell add even land here must big high such follow act why ask men
change went light kind off need house picture try us again animal point mother world near build
self earth father head stand own page should country found answer school grow study still learn
plant cover food sun four between state keep eye never last let thought city tree cross farm
hard start might story saw far sea draw left late run while press close night real life few
north open seem together next white children begin got walk example ease paper group always
music those both mark often letter until mile river car feet care second book carry took
science eat room friend began idea fish mountain stop once base hear horse cut sure watch color
face wood main enough plain girl usual young ready above ever red list though feel talk bird
soon body dog family direct pose leave song measure door product black short numeral class wind
question happen complete ship area half rock order fire south problem piece told knew pass since
top whole king space heard best hour better true during hundred five remember step early hold
west ground interest reach fast verb sing listen six table travel less morning ten simple
several vowel toward war lay against pattern slow center love person money serve appear road map
rain rule govern pull cold notice voice unit power town fine certain fly fall lead cry dark
machine note wait plan figure star box noun field rest correct able pound done beauty drive
stood contain front teach week final gave green oh quick develop ocean warm free minute strong
special mind behind clear tail produce fact street inch multiply nothing course stay wheel full
force blue object decide surface deep moon island foot system busy test record boat common gold
possible plane stead dry wonder laugh thousand ago ran check game shape equate miss brought heat
snow tire bring yes distant fill east paint language among hello model expert token memory
""".split()


@dataclass(frozen=True)
class SynthVocab:
    """Token strings, scores and llama.cpp token types, index = token id."""

    tokens: tuple[str, ...]
    scores: tuple[float, ...]
    token_types: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.tokens)


def pad_tokens(start: int, stop: int) -> Iterator[str]:
    """The padding tokens of ids ``start..stop-1``: ``[PADid]``, as llama.cpp's converter pads a
    vocabulary to the model's row count. The tokenizer never produces them: no merge reaches
    them ("[P" is not a token) and unused tokens are not special-cased."""
    return (f"[PAD{i}]" for i in range(start, stop))


@lru_cache(maxsize=4)
def build_vocab(size: int = 0) -> SynthVocab:
    """The fixed synthetic vocabulary (deterministic; 1,621 tokens), padded with unused
    ``[PADn]`` tokens to ``size`` tokens when ``size`` is larger (real models' row counts)."""
    tokens: list[str] = list(_CONTROL)
    types: list[int] = [TOKEN_UNKNOWN] + [TOKEN_CONTROL] * (len(_CONTROL) - 1)
    scores: list[float] = [0.0] * len(_CONTROL)
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        types.append(TOKEN_BYTE)
        scores.append(0.0)
    seen = set(tokens)

    def add(piece: str, score: float) -> None:
        if piece not in seen:
            seen.add(piece)
            tokens.append(piece)
            types.append(TOKEN_NORMAL)
            scores.append(score)

    add(SPACE, -1.0)
    for code in range(33, 127):  # printable ASCII except the space, which SPM writes as "▁"
        add(chr(code), -2.0)
    for word in _WORDS:
        piece = SPACE + word
        # Every prefix must exist so the SPM merge loop can grow the word one char at a time;
        # longer pieces score higher so whole words win over their prefixes.
        for end in range(2, len(piece) + 1):
            add(piece[:end], float(end) - 100.0)
    if size > len(tokens):
        pad = size - len(tokens)
        tokens += pad_tokens(len(tokens), size)
        types += [TOKEN_UNUSED] * pad
        scores += [0.0] * pad
    return SynthVocab(tokens=tuple(tokens), scores=tuple(scores), token_types=tuple(types))
