"""Small user tools shipped with the package (``autoplace trace-summary``)."""
