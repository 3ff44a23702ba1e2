"""How every lab check fails: with a hint in Chinese and English.

``fail(zh, en)`` raises the ``AssertionError`` a notebook shows::

    <where zh><zh>
    / <where en><en>

``call(fn, name, *args)`` runs a student's function and turns what it raises
into such a hint, so a crash reads like any other failed check. A stub's
``NotImplementedError`` and a check's own ``AssertionError`` pass through.
"""

from __future__ import annotations

__all__ = ["NOT_WRITTEN", "NOWHERE", "at_step", "call", "fail", "hint"]

# A place in a check, to put before the hint: (Chinese, English).
NOWHERE = ("", "")

# What a stub raises, seen through a wrapper: "something is not written yet".
NOT_WRITTEN = "还有没写完的部分 / something is not written yet"


def at_step(step: int | None) -> tuple[str, str]:
    """The place "step N" of a step-by-step check; nothing when ``step`` is None."""
    return NOWHERE if step is None else (f"第 {step} 步：", f"step {step}: ")


def hint(zh: str, en: str, where: tuple[str, str] = NOWHERE) -> str:
    """The text of a hint: ``zh`` and ``en``, each after its half of ``where``."""
    return f"{where[0]}{zh}\n/ {where[1]}{en}"


def fail(zh: str, en: str, where: tuple[str, str] = NOWHERE):
    """Raise ``AssertionError`` with the hint ``zh`` / ``en``."""
    raise AssertionError(hint(zh, en, where))


def call(fn, name: str, /, *args, where: tuple[str, str] = NOWHERE, stub: str | None = None,
         let_through: tuple[type[BaseException], ...] = (NotImplementedError, AssertionError),
         explain=None, **kwargs):
    """``fn(*args, **kwargs)``, the student's code; what it raises becomes a hint.

    * ``let_through``: exceptions raised as they are (a stub, a check's own hint).
    * ``stub``: when the error's text mentions ``NotImplementedError`` (Triton's
      interpreter wraps what a kernel raised), raise ``NotImplementedError(stub)``.
    * ``explain(name, error) -> (zh, en) | None``: a hint for this kind of error.
    * otherwise: "``name`` 抛出了 ``Type: message``" / "``name`` raised ``Type: message``".

    The options' names are taken: ``fn`` cannot receive keyword arguments of these names.
    """
    try:
        return fn(*args, **kwargs)
    except let_through:
        raise
    except Exception as e:
        text = f"{type(e).__name__}: {e}"
        if stub is not None and "NotImplementedError" in text:
            raise NotImplementedError(stub) from None
        said = explain(name, e) if explain is not None else None
        zh, en = said or (f"{name} 抛出了 {text}", f"{name} raised {text}")
        raise AssertionError(hint(zh, en, where)) from e
