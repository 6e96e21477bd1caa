"""pytest's assertion rewriting and explanations, in a rank.

In the pytest process a rewritten ``assert`` that fails asks pytest's
``pytest_assertrepr_compare`` hook to explain the comparison (``At index 2
diff: 3 != 4``, a text diff, the differing keys of dicts), through a function
pytest installs for the running test. A rank has no pytest session, so the
pytest process sends the options those explanations read
(:func:`assertion_options`: the verbosity and the ``truncation_limit_*`` and
``assertion_text_diff_style`` ini values), and the rank answers the same
questions from them (:class:`OptionsConfig`) while a test runs
(:func:`assertion_explanations`). ``pytest_assertrepr_compare`` hooks of the
user's conftest files do not run in a rank: it explains with pytest's own.

Both ends use pytest's private API (``_pytest.assertion``), which changes between
pytest releases: where it does not fit, a failing ``assert`` still reports its
values, without the detailed explanation.
"""

from __future__ import annotations

import ast
import contextlib
from collections.abc import Iterator
from types import CodeType
from typing import Any

__all__ = ["OptionsConfig", "assertion_options", "assertion_explanations",
           "compile_with_rewritten_asserts"]

#: The ini values pytest's assertion explanations read (those this pytest knows are sent).
_INI_NAMES = ("truncation_limit_lines", "truncation_limit_chars", "assertion_text_diff_style")


def assertion_options(config: Any) -> dict[str, Any]:
    """What a rank needs of the pytest process's ``config`` to explain failed asserts."""
    try:
        from _pytest.config import Config

        verbose = int(config.get_verbosity())
        assertions = int(config.get_verbosity(Config.VERBOSITY_ASSERTIONS))
    except (ImportError, AttributeError, TypeError, ValueError):  # an older pytest
        verbose = assertions = int(config.getoption("verbose", 0) or 0)
    ini: dict[str, Any] = {}
    for name in _INI_NAMES:
        with contextlib.suppress(ValueError, KeyError):  # not an ini option of this pytest
            ini[name] = config.getini(name)
    return {"verbose": verbose, "verbose_assertions": assertions, "ini": ini}


class _NoPlugins:
    """A plugin manager that has no plugin (so explanations stay plain text)."""

    def has_plugin(self, name: str) -> bool:
        return False


class OptionsConfig:
    """Stands for pytest's ``Config`` where pytest's assertion explanations read it.

    Args:
        options: What :func:`assertion_options` returned in the pytest process.
    """

    def __init__(self, options: dict[str, Any]) -> None:
        self._verbose = int(options.get("verbose", 0))
        self._verbose_assertions = int(options.get("verbose_assertions", self._verbose))
        self._ini: dict[str, Any] = dict(options.get("ini", {}))
        self.pluginmanager = _NoPlugins()

    def get_verbosity(self, verbosity_type: str | None = None) -> int:
        """The verbosity of assertions (any type given), or the global one."""
        return self._verbose if verbosity_type is None else self._verbose_assertions

    def getini(self, name: str) -> Any:
        """The pytest process's ini value ``name`` (None: unset there, or not sent)."""
        return self._ini.get(name)

    def getoption(self, name: str, default: Any = None, skip: bool = False) -> Any:
        """``verbose`` as sent; ``assertmode`` is ``rewrite``; else ``default``."""
        return {"verbose": self._verbose, "assertmode": "rewrite"}.get(name, default)

    getvalue = getoption


@contextlib.contextmanager
def assertion_explanations(options: dict[str, Any]) -> Iterator[None]:
    """While the block runs, failed rewritten asserts get pytest's explanations.

    Args:
        options: What :func:`assertion_options` returned in the pytest process.
    """
    try:
        from _pytest.assertion import pytest_assertrepr_compare, util
    except ImportError:  # another pytest: asserts report their values only
        yield
        return
    config = OptionsConfig(options)

    def explain(op: str, left: object, right: object) -> str | None:
        # As pytest's own (``_pytest.assertion.pytest_runtest_protocol``) does with
        # the hook's answer: lines joined for format_explanation, % escaped.
        try:
            lines = pytest_assertrepr_compare(
                config=config, op=op, left=left, right=right)  # type: ignore[arg-type]  # stands for Config
        except Exception:  # an explanation must never hide the failure itself
            return None
        if not lines:
            return None
        return "\n~".join(line.replace("\n", "\\n") for line in lines).replace("%", "%%")

    # pytest's rewritten asserts call util._reprcompare and read util._config
    saved = util._reprcompare, util._config  # noqa: SLF001  # pytest's hook for rewritten asserts
    util._reprcompare = explain  # noqa: SLF001  # the same hook
    util._config = config  # type: ignore[assignment]  # noqa: SLF001  # stands for Config
    try:
        yield
    finally:
        util._reprcompare, util._config = saved  # noqa: SLF001  # the same hook


def compile_with_rewritten_asserts(path: str) -> CodeType:
    """The code of the module file ``path``, its asserts rewritten as pytest does."""
    with open(path, "rb") as f:
        source = f.read()
    tree = ast.parse(source, filename=path)
    try:
        from _pytest.assertion.rewrite import rewrite_asserts

        rewrite_asserts(tree, source, path, None)
    except Exception:  # another pytest: plain asserts still fail, with less detail
        tree = ast.parse(source, filename=path)
    return compile(tree, path, "exec", dont_inherit=True)
