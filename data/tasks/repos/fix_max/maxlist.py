def largest(xs):
    """Return the largest element of a non-empty list."""
    best = xs[0]
    for i in range(1, len(xs) - 1):
        if xs[i] > best:
            best = xs[i]
    return best
