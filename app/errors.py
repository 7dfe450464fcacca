"""The one exception type that means 'the user asked for something we cannot do'."""


class UserError(Exception):
    """A mistake in the user's input: reported as one line on stderr, never as a traceback."""
