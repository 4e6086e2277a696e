"""One file per schema revision, applied in order; never edit a released one, add the next."""
