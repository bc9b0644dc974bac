"""An exception that an adapter raises inside JAX traces to abort them and trace again."""

from __future__ import annotations

from jaxoverride._compat import current_trace, release_trace


class TraceAbort(BaseException):
    """Aborts the JAX traces it is raised through; the adapter that catches it traces
    again (with more state given, another layout, ...).

    A ``BaseException``, so that user code that catches ``Exception`` cannot swallow it.
    It remembers the trace it was raised in. JAX frees a trace when it ends normally, but
    not one that an exception aborts: there, the ``weakref.finalize`` callback of each of
    its constants keeps the trace alive for good, with the tracers of the enclosing
    traces that it holds as constants (``jax.checking_leaks()`` reports them). The catcher
    calls ``release()`` to free the traces that the exception aborted on its way.

    Example:
      >>> import jax
      >>> from jaxoverride import adapter_kit
      >>> class NeedsMore(adapter_kit.TraceAbort):
      ...     pass
      >>> def traced(x):
      ...     raise NeedsMore()
      >>> try:
      ...     jax.jit(traced)(1.0)
      ... except NeedsMore as abort:
      ...     abort.release()  # then trace again
    """

    def __init__(self, *args: object):
        super().__init__(*args)
        self.raised_in = current_trace()

    def release(self) -> None:
        """Frees the traces between the one this was raised in and the one running now,
        which caught it (they are over). Nothing if the one running now is not among the
        traces this was raised inside."""
        catcher = current_trace()
        if catcher is None:  # inside a primitive's rules: the chain is out of reach
            return
        aborted = []
        trace = self.raised_in
        while trace is not None and trace is not catcher:
            aborted.append(trace)
            trace = getattr(trace, "parent_trace", None)
        if trace is catcher:
            for each in aborted:
                release_trace(each)
