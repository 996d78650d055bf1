"""Root cause inside the responsible step: which operation made the first non-finite value (``operations``),
which samples of the batch (``samples``), what in the data (``data``), what drifted before it
(``precursors``), and the findings in plain words (``findings``)."""
