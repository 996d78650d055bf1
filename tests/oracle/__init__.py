"""An oracle of the project's own (issue 31): a seeded generator of small training programs (``programs``), a
deliberately simple and slow reference monitor that shares no code with the replay (``reference``), and the property
that ties them (``check``): the replay of a program's recorded run agrees with the reference, or refuses the run up
front. ``python -m tests.oracle --programs N`` is the long run by hand; ``--large-batches`` draws each seed's program
with a batch above rootcause/samples.py's ALONE_UP_TO (``programs.LARGE_SIZES``), where samples are judged by group
testing and held to the weaker claim its report makes (``check.samples_claim``)."""
