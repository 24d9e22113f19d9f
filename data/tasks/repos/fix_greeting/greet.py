def greeting(name):
    """Return a greeting such as 'Hello, Ada!'."""
    return "Goodbye, " + name + "!"
