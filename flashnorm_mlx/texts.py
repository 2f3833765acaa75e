"""Offline English text that ships with Python: evaluation and calibration halves."""


def _topics(parity: int) -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics)[parity::2])


def default_text() -> str:
    """English prose that ships with Python: the even-numbered pydoc help topics
    (~60k tokens; the odd-numbered ones calibrate quantization, never scored)."""
    return _topics(0)


def calibration_text() -> str:
    """The odd-numbered pydoc help topics: calibration text for `gptq`, disjoint
    from `default_text` whatever the window size."""
    return _topics(1)
