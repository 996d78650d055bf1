"""``python -m nanforensics`` (and ``torchrun -m nanforensics``).

The working directory Python put first on ``sys.path`` came off when the package was imported, before this module
(the package's ``__init__``: its bootstrap), so a module file in the folder the command runs in (``cd RUN && python -m
nanforensics replay .``: a ``typing.py``, or a ``gmpy2.py`` that sympy would import) is never picked up."""

from .cli import main

main()
