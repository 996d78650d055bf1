"""A fuzzer of real artifacts (issue 32): seeds of every layout the commands read (``seeds``), structural mutators
(``mutate``), every command run on every mutant as a process under time and memory limits with the README's
invariants checked (``oracle``), crashes classed, minimised and kept (``campaign``, ``corpus.json``).

By hand: ``python -m tests.fuzz --mutants 2000`` (see ``__main__``); in the suite: tests/test_fuzz.py."""
