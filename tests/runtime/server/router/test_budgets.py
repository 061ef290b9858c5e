"""The budget pools of router mode: a model's ask resolved against its device's pool,
reservations that never sum past it (check, then change), the manager's real budget
settled after a load, and hypothesis' random loads and unloads keeping the books."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runtime.server.router.budgets import Ask, BudgetPool

MIB = 1 << 20


def test_an_ask_is_a_size_a_share_of_the_pool_or_the_default_share():
    assert Ask("cpu", bytes=3 * MIB).resolve(12 * MIB, 0.25) == 3 * MIB
    assert Ask("cpu", share=0.5).resolve(12 * MIB, 0.25) == 6 * MIB
    assert Ask("cpu").resolve(12 * MIB, 0.25) == 3 * MIB


def test_reservations_fit_the_pool_or_say_what_is_missing():
    pool = BudgetPool({"cpu": 10 * MIB})
    assert pool.fits({"cpu": 6 * MIB})
    pool.reserve("a", {"cpu": 6 * MIB, "cuda:0": 1 * MIB})     # an unpooled device: not kept
    assert pool.held("a") == {"cpu": 6 * MIB}
    assert pool.shortfall({"cpu": 5 * MIB}) == {"cpu": 1 * MIB}
    assert not pool.fits({"cpu": 5 * MIB}) and pool.free("cpu") == 4 * MIB
    with pytest.raises(AssertionError):
        pool.reserve("b", {"cpu": 5 * MIB})            # reserve() asserts what fits() says
    assert pool.never_fits({"cpu": 11 * MIB}) == {"cpu": 11 * MIB}
    assert pool.never_fits({"cpu": 5 * MIB}) == {}
    pool.release("a")
    assert pool.fits({"cpu": 10 * MIB}) and pool.to_dict()["cpu"]["models"] == {}


def test_settle_records_the_managers_real_budget():
    pool = BudgetPool({"cpu": 10 * MIB})
    pool.reserve("a", {"cpu": 1 * MIB})
    pool.settle("a", {"cpu": 2 * MIB, "cpu-slots": 5})   # a tier's working-set floor
    assert pool.held("a") == {"cpu": 2 * MIB} and pool.reserved("cpu") == 2 * MIB


@given(st.lists(st.tuples(st.sampled_from("abcd"), st.integers(0, 12)), max_size=40))
def test_the_books_never_pass_the_pool(steps):
    pool = BudgetPool({"cpu": 10})
    for model, size in steps:
        if model in pool.held_models():
            pool.release(model)
        elif pool.fits({"cpu": size}):
            pool.reserve(model, {"cpu": size})
        assert 0 <= pool.reserved("cpu") <= 10
        assert pool.reserved("cpu") + pool.free("cpu") == 10
