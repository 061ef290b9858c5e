"""The residency core's Python reference, tests only: ``core.ReferenceCore`` (the rules of
runtime/residency/core's C core, in plain Python) and the learned policies' models
(``next_visit``, ``affinity`` with its ``neighbours``), each the twin of a file in
runtime/residency/core/models/. The policies' reference classes are runtime/residency/policies/
(beside the registry that names them). Tests drive a reference and a C core with the same
calls and compare (tests/runtime/residency/test_core_reference.py).

Empty on purpose: the policies' reference classes import the models from here, below the
registry, so this package imports nothing."""
