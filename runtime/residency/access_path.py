"""The residency manager's hot path: ``access_layer`` and its one-pass lru path.

A mixin of ``ExpertResidencyManager`` (manager.py owns the state these methods use: the lock,
devices, leases, policies). The one-pass path is taken for lru + admission always + no
prefetch + the inline transport with nothing leased, pinned or in flight on the device;
everything else goes to the general path (general_path.py). Both decide by the same rules;
tests compare them. The per-element work is ``lru_step`` (lru_step.py, and its C version).
"""
from __future__ import annotations

from runtime.residency.device_state import ABSENT, DeviceState
from runtime.residency.types import LayerAccess, Phase, UpcomingStep

_EMPTY: tuple = ()
_new_tuple = tuple.__new__  # builds a LayerAccess without its Python-level __new__


class AccessPathMixin:
    def access_layer(self, device: str, layer: int, experts, phase: Phase, *,
                     step: int = 0, next_use=None, upcoming: UpcomingStep | None = None,
                     lease: bool = True, release: LayerAccess | None = None) -> LayerAccess:
        """Record one layer-step's routed experts; see contracts.md ("Residency").

        experts: (n_tokens * k,) int expert ids in routing order, each in [0, n_expert)
        (ndarray or list). next_use: same shape, the access index of each element's next use
        (offline policies only). With ``lease`` the experts stay leased until
        ``release(access)``; ``lease=False`` holds them only during this call (replay).
        ``release``: an earlier access whose leases end first, under the same lock
        acquisition (the live hooks end the previous layer-step's lease this way); exactly
        ``release(that)`` followed by this call.
        """
        try:
            st = self._devices[device]
        except KeyError:
            self._unknown_device(device)
        el = experts if type(experts) is list else experts.tolist()
        if not st.fast[phase]:                           # policies need the general path
            if release is not None:
                self.release(release)
            return self._access_general(st, device, layer, el, phase, next_use, upcoming, lease)
        lock = self._lock
        lock.acquire()
        try:
            if release is not None:
                if release.device == device:
                    st.leases.pop(release.lease_id, None)
                else:
                    self.release(release)
            # (st.fast again: set_transport or reconfigure may have run since the check)
            if not st.fast[phase] or st.leases or st.tickets or st.n_pf_unused \
                    or st.pins_by_layer:
                access = None                            # the general path, below
            else:
                # The one-pass lru path: lru alone, admit always, no prefetch, inline
                # transport, nothing leased, pinned or in flight on this device (replay, and
                # the live decode loop between layers). It decides exactly as the general
                # path (tests compare them): every element touches its key in routing order
                # (a missed key is placed in the order at its first access and marked
                # resident at once, so its repeats are hits), then the misses are admitted in
                # routing order, each evicting the least recent keys not touched by this
                # call. The per-element part is lru_step (C, or its Python reference).
                try:
                    # flat_of: {expert id: flat key}; b: bytes of one expert of the layer
                    base, flat_of, b = self._layer_flat[layer]
                except (KeyError, TypeError):            # a dense layer, or no such layer
                    self._no_layer(layer)
                seq0 = self._seq
                n = len(el)
                self._seq = seq0 + n
                try:
                    tr, missed, evicted, freed = self._lru_step(
                        st.core, flat_of, el, seq0, phase, b, st.capacity - st.resident_bytes)
                except LookupError as exc:               # an id outside [0, n_expert)
                    self._bad_expert(exc.args[0])
                if lease:
                    lease_id = self._next_lease
                    self._next_lease = lease_id + 1
                    st.leases[lease_id] = (base, el)
                else:
                    lease_id = 0
                tally = st.tally[phase]
                tally.accesses += n
                if tr:
                    if phase == 1:                       # transition hits: decode only
                        tally.transition_hits += tr
                    else:
                        tr = 0
                if missed is None:                       # all hit
                    return _new_tuple(LayerAccess, (device, layer, phase, n, 0, 0, _EMPTY,
                                                    _EMPTY, _EMPTY, _EMPTY, tr, lease_id))
                if evicted is None:                      # too few unleased keys: one by one
                    access, evicted = self._admit_each(
                        st, device, layer, base, [base + k.expert for k in missed], n, phase,
                        seq0, tr, lease_id, tally)
                else:
                    m = len(missed)
                    mb = m * b
                    n_ev = len(evicted)
                    if n_ev:
                        tally.evictions += n_ev
                        tally.evicted_bytes += freed
                    st.resident_bytes += mb - freed
                    st.resident_count += m - n_ev
                    tally.misses += m
                    tally.demand_miss_bytes += mb
                    tally.admissions += m
                    tally.admitted_bytes += mb
                    access = _new_tuple(LayerAccess, (device, layer, phase, n - m, m, mb,
                                                      missed, evicted, _EMPTY, _EMPTY,
                                                      tr, lease_id))
                if not evicted or self._drop_noop:
                    return access
        finally:
            lock.release()
        if access is None:
            return self._access_general(st, device, layer, el, phase, next_use, upcoming, lease)
        drop = self._transport.drop                      # never call out under the lock
        for key in evicted:
            drop(device, key)
        return access

    def _admit_each(self, st: DeviceState, device: str, layer: int, base: int,
                    missed: list[int], n: int, phase: Phase, seq0: int, tr: int,
                    lease_id: int, tally) -> tuple[LayerAccess, tuple]:
        """The misses of a one-pass lru call when the unleased keys cannot make room for all
        of them (flat keys in routing order, each placed in the order at its access and
        marked resident), admitted one by one in routing order, each evicting the least recent
        keys not touched by this call; a miss that cannot fit is used transiently.
        Returns (the access, the evicted keys)."""
        state, last, keys, nbytes = st.state, st.stats.last_seq, st.keys, st.bytes_flat
        od = st.lru_od
        b = nbytes[base]
        free = st.capacity - st.resident_bytes
        admitted = []
        evicted = []
        transient = None
        evicted_bytes = 0
        popitem = od.popitem
        for f in missed:
            if free < b:
                v = popitem(False)[0]                # the least recent key
                bv = nbytes[v]
                if free + bv >= b and last[v] < seq0:    # one victim suffices: the usual case
                    state[v] = ABSENT
                    evicted.append(keys[v])
                    free += bv - b
                    evicted_bytes += bv
                    state[f] = phase
                    admitted.append(keys[f])
                    continue
                od[v] = None                         # put it back; take the general route
                od.move_to_end(v, last=False)
                victims = []
                freed = 0
                while free + freed < b:
                    v = popitem(False)[0]            # the least recent key
                    if last[v] >= seq0:              # touched by this call: so is the rest
                        od[v] = None
                        od.move_to_end(v, last=False)
                        break
                    victims.append(v)
                    freed += nbytes[v]
                if free + freed < b:                 # cannot fit: evict nothing, use it once
                    for v in reversed(victims):
                        od[v] = None
                        od.move_to_end(v, last=False)
                    state[f] = ABSENT
                    del od[f]
                    if transient is None:
                        transient = [keys[f]]
                    else:
                        transient.append(keys[f])
                    continue
                for v in victims:
                    state[v] = ABSENT
                    evicted.append(keys[v])
                free += freed
                evicted_bytes += freed
            state[f] = phase
            free -= b
            admitted.append(keys[f])
        n_adm, n_ev = len(admitted), len(evicted)
        misses = len(missed)
        tally.misses += misses
        tally.demand_miss_bytes += misses * b
        tally.admissions += n_adm
        tally.admitted_bytes += n_adm * b
        st.resident_bytes = st.capacity - free
        st.resident_count += n_adm - n_ev
        if transient is not None:
            tally.transient_uses += len(transient)
            tally.transient_bytes += len(transient) * b
            transient = tuple(transient)
        if n_ev:
            tally.evictions += n_ev
            tally.evicted_bytes += evicted_bytes
            evicted = tuple(evicted)
        else:
            evicted = _EMPTY
        return _new_tuple(LayerAccess, (device, layer, phase, n - misses, misses, misses * b,
                                        tuple(admitted), evicted, transient or _EMPTY, _EMPTY,
                                        tr, lease_id)), evicted
