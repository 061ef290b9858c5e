"""Residency policies: small objects with pure methods, built by name in ``factory``."""
