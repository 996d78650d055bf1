"""Views: a report rendered for the terminal, Markdown, JUnit or HTML. They compute nothing; every figure and
sentence comes from the report."""
