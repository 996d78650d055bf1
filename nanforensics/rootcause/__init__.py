"""Root cause inside the responsible step: the operation where the origin's value was born (``operations``),
which samples of the batch (``samples``), what in the data (``data``), what drifted before it
(``precursors``), and the findings in plain words (``findings``)."""

DEFAULT_MAX_ABS = 1e6  # batch values beyond this magnitude are data defects; here, so the CLI has it without torch
