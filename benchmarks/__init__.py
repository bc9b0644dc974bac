"""Side-by-side measurements of jaxoverride against raw JAX and its peers (``make bench``)."""
