"""``python -m nanforensics`` (and ``torchrun -m nanforensics``).

Python put the working directory first on ``sys.path`` for ``-m``; it comes off before anything else is imported, so a
module file in the folder the command runs in (``cd RUN && python -m nanforensics replay .``: a ``gmpy2.py`` that sympy
would import) is never picked up. The trust policy adds the working directory back for the import of a run's code it
allows, and only then (``runs.imports``)."""

import os
import sys

if sys.path and sys.path[0] and os.path.realpath(sys.path[0]) == os.path.realpath(os.getcwd()):
    del sys.path[0]

from .cli import main  # noqa: E402 - after sys.path is cleaned

main()
