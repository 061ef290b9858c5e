"""The per-element core of the one-pass lru path, in Python (the reference) and in C.

``lru_step`` touches one layer-step's routed experts in routing order and picks the victims
that make room for its misses. It is the part of ``access_layer`` that runs once per element;
the manager keeps everything else (lock, leases, counters, the result record). The C version
(``_lru_step.c``, built on first use by ``runtime.residency.native_step``) follows this
function line by line; tests run streams through both and expect identical decisions.

Arguments (the manager's own objects, changed in place):
  core: (state, last, od, move, popitem, keys, nbytes) of one device:
    state: bytearray, per flat key: 0..2 resident (admitting Phase), 8 ABSENT (no other state
      occurs on this path: nothing is pending or evicting);
    last: array('q'), per flat key: last access sequence number;
    od: OrderedDict of the resident flat keys in last-access order (lru first); move, popitem:
      its bound move_to_end and popitem;
    keys: list of ExpertKey per flat key; nbytes: list of bytes per flat key.
  flat_of: {expert id: flat key} of the layer; el: list of expert ids (routing order);
  seq0: the sequence number of el[0]; phase: int Phase; b: bytes of one expert of the layer;
  free: capacity minus resident bytes.

Returns (tr, missed, evicted, freed):
  tr: hits on keys admitted in PREFILL (state 0);
  missed: None when every element hit, else a tuple of the missed ExpertKeys in routing
    order (first occurrences; each is marked resident with ``phase`` and placed in the order at its
    access, so its repeats are hits);
  evicted: the victims (ExpertKeys, lru first; () when the free bytes suffice), now ABSENT
    and out of the order, ``freed`` their bytes; or None when the unleased keys cannot make
    room for every miss: then nothing was evicted and the caller admits the misses one by one.
An element that is not an expert id of the layer raises ``LookupError(element)`` after
undoing this call's misses (the elements before it stay touched).
"""
from __future__ import annotations

ABSENT = 8


def lru_step(core: tuple, flat_of: dict, el: list, seq0: int, phase: int, b: int,
             free: int) -> tuple:
    """The reference implementation (see the module docstring)."""
    state, last, od, move, popitem, keys, nbytes = core
    tr = 0
    missed = None
    seq = seq0
    for e in el:
        try:
            f = flat_of[e]
        except (KeyError, TypeError):
            for key in missed or ():                  # undo this call's misses
                g = flat_of[key.expert]
                state[g] = ABSENT
                del od[g]
            raise LookupError(e) from None
        s = state[f]
        if s == ABSENT:                               # a demand miss
            state[f] = phase
            od[f] = None
            if missed is None:
                missed = [keys[f]]
            else:
                missed.append(keys[f])
        else:
            if s == 0:
                tr += 1
            move(f)
        last[f] = seq
        seq += 1
    if missed is None:
        return tr, None, (), 0
    need = len(missed) * b - free                     # bytes to free
    if need <= 0:
        return tr, tuple(missed), (), 0
    # the victims of all misses together: the shortest prefix of the order that frees
    # ``need`` bytes (what admitting them one by one takes). The order is sorted by last
    # access, so if its newest victim was not touched by this call, none was; and it holds
    # the misses' own bytes, so it cannot run dry.
    victims = []
    freed = 0
    while freed < need:
        v = popitem(False)[0]
        victims.append(v)
        freed += nbytes[v]
    if last[v] >= seq0:                               # too few unleased keys: put back
        for v in reversed(victims):
            od[v] = None
            move(v, False)
        return tr, tuple(missed), None, 0
    evicted = []
    for v in victims:
        state[v] = ABSENT
        evicted.append(keys[v])
    return tr, tuple(missed), tuple(evicted), freed
