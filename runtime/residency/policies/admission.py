"""Admission policies' Python references: each one pure ``admit`` (may a demand miss that found
its victims become resident, or is it used transiently?). The C twins: one file each,
runtime/residency/core/policies/admit_*.c."""
from __future__ import annotations


class Always:
    @staticmethod
    def admit(stats, phase: int, f: int, victims: list[int], param: float) -> bool:
        return True


class ReuseThreshold:
    """decode: once routed ``break_even`` times (prefill: always)."""

    @staticmethod
    def admit(stats, phase, f, victims, param):
        u = stats.uses
        return phase == 0 or u[0][f] + u[1][f] + u[2][f] >= param


class TransientOnPressure:
    """unless the first victim was used within ``window`` accesses."""

    @staticmethod
    def admit(stats, phase, f, victims, param):
        return not victims or stats.last[f] - stats.last[victims[0]] > param


class BeladyBypass:
    """offline: only if used again before the first victim."""

    @staticmethod
    def admit(stats, phase, f, victims, param):
        return not victims or stats.next_use[f] < stats.next_use[victims[0]]
