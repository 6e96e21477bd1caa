"""In a rank: import a test's module, run the test function, say how it went.

The module is imported the way pytest imported it in the parent (same name, the
parent's ``sys.path``), with pytest's assertion rewriting when the module is
loaded here for the first time, so a failing ``assert`` reports its values. The
function's arguments arrive as values, except :class:`RankFixture` stand-ins,
which become this rank's ``rank``, ``world_size``, groups. What the test writes
to file descriptors 1 and 2 is captured and sent back with the result; it goes to
a file the pytest process can read too (the rank's output file), so the output
of a rank that hangs or dies is not lost, and Python's ``sys.stdout`` and
``sys.stderr`` are line-buffered meanwhile, so that a line printed is in the
file. The test runs under pytest's warning filters (the ini's
``filterwarnings``, ``-W``, the test's ``filterwarnings`` marks), as in the
pytest process.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import io
import os
import pickle
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from coordinator.pytest_plugin.assertions import (
    assertion_explanations,
    compile_with_rewritten_asserts,
)
from coordinator.pytest_plugin.protocol import (
    FAILED,
    PASSED,
    SKIPPED,
    XFAILED,
    RankFixture,
    RankResult,
    TestCall,
    type_names,
)

__all__ = ["RANK_FIXTURES", "import_test_module", "run_call", "read_output", "safe_str"]

#: The rank's fixtures, by name: what each is in a rank.
RANK_FIXTURES = ("rank", "world_size", "local_rank", "group", "tp_group", "pp_group", "dp_group")

#: The most output of one rank sent back (its end is kept).
_MAX_OUTPUT = 20_000


def import_test_module(call: TestCall) -> None:
    """Import ``call``'s module now, if it is not yet (a failure is left for
    :func:`run_call` to report): what its top-level code does then holds for
    every test of the module, as in the pytest process."""
    with contextlib.suppress(BaseException):
        _test_function(call)


def run_call(call: TestCall, rank: int, world_size: int, local_rank: int,
             output_path: str | None = None) -> RankResult:
    """Run ``call`` here; never raises (a failure is in the result).

    ``output_path``: the file the test's output goes to (emptied first); None:
    a temporary file.
    """
    __tracebackhide__ = True  # pytest: the report starts at the test function
    import pytest

    with _captured_fds(output_path) as output, assertion_explanations(call.assertion_options):
        try:
            with _warning_filters(call.warning_filters):
                owner, fn = _test_function(call)
                kwargs = {k: _rank_value(v, rank, world_size, local_rank)
                          for k, v in pickle.loads(call.kwargs).items()}
                with _xunit_setup(owner, fn):
                    returned = _check_returned(fn(**kwargs), call)
            result = RankResult(rank, PASSED, returned=returned)
        except pytest.skip.Exception as e:
            result = RankResult(rank, SKIPPED, summary=str(e.msg or ""))
        except pytest.xfail.Exception as e:  # before fail.Exception: XFailed is a Failed
            result = RankResult(rank, XFAILED, summary=str(e.msg or ""))
        except BaseException as e:
            result = RankResult(rank, FAILED, summary=_summary(e),
                                traceback=format_failure(e, call.tb_style, call.showlocals),
                                exception_types=type_names(type(e)))
    result.output = _tail(output[0]) if output else ""
    return result


def read_output(path: str) -> str:
    """What a rank wrote to its output file ``path`` (its end, as :func:`run_call`
    sends it back); empty when there is none."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 4 * _MAX_OUTPUT))  # at most 4 bytes a character
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return _tail(text, dropped=max(0, size - 4 * _MAX_OUTPUT))


def _tail(text: str, dropped: int = 0) -> str:
    """The end of ``text`` that is sent back, saying what was left out."""
    if len(text) <= _MAX_OUTPUT and not dropped:
        return text
    cut = text[-_MAX_OUTPUT:]
    newline = cut.find("\n")
    if 0 <= newline < 200:  # start at a whole line
        cut = cut[newline + 1:]
    return (f"[groupcoord pytest plugin: the rank's output was longer; only its last "
            f"{len(cut)} characters are shown]\n{cut}")


def _check_returned(out: Any, call: TestCall) -> str:
    """Refuse a body that did not run: a coroutine or generator the call only made.

    Returns:
        A description of ``out`` when it is not None (pytest warns of a test
        function that returns a value), else ``""``.
    """
    __tracebackhide__ = True
    if inspect.isawaitable(out) or inspect.isgenerator(out):
        close = getattr(out, "close", None)
        if close is not None:
            close()  # never started: nothing of the test ran
        raise TypeError(f"{call.nodeid}: the test function returned a "
                        f"{type(out).__name__}; async and generator test functions cannot "
                        f"run as distributed tests (the body would never run)")
    if out is None:
        return ""
    try:
        text = repr(out)
    except Exception:
        text = f"a {type(out).__name__}"
    return text if len(text) <= 200 else text[:197] + "..."


def _summary(e: BaseException) -> str:
    import pytest

    if isinstance(e, pytest.fail.Exception):
        return f"Failed: {e.msg}"
    text = safe_str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def safe_str(e: BaseException) -> str:
    """``str(e)``, or a stand-in when the exception's ``__str__`` itself raises: the
    rank must still report the failure (an error escaping here ends the rank, and
    the report would say it died, without the test's traceback)."""
    try:
        return str(e)
    except Exception:
        return f"<{type(e).__name__}: str() failed>"


def format_failure(e: BaseException, tb_style: str, showlocals: bool = False) -> str:
    """``e`` as pytest prints a failure (``tb_style``: ``long``, ``short``, ``native``;
    ``showlocals``: with each frame's local variables), without this module's frames."""
    import pytest

    try:
        info = pytest.ExceptionInfo.from_exception(e)
        style: Any = tb_style if tb_style in ("long", "short", "native") else "long"
        return _render(info.getrepr(style=style, tbfilter=True, showlocals=showlocals))
    except Exception:  # pytest could not format it: Python's own format still tells
        return "".join(traceback.format_exception(type(e), e, e.__traceback__))


def _render(repr_: Any) -> str:
    """A pytest ``TerminalRepr`` as text, each line as pytest prints it (its ``str()``
    strips the first line's indentation), without blank lines around it."""
    from _pytest._io import TerminalWriter

    out = io.StringIO()
    repr_.toterminal(TerminalWriter(file=out))
    return out.getvalue().lstrip("\n").rstrip()


def _rank_value(value: Any, rank: int, world_size: int, local_rank: int) -> Any:
    __tracebackhide__ = True  # pytest: a failure here is reported from the test's view
    if not isinstance(value, RankFixture):
        return value
    from coordinator import parallel_state as ps

    getters: dict[str, Callable[[], Any]] = {
        "rank": lambda: rank, "world_size": lambda: world_size,
        "local_rank": lambda: local_rank, "group": ps.get_world_group,
        "tp_group": ps.get_tp_group, "pp_group": ps.get_pp_group, "dp_group": ps.get_dp_group,
    }
    if value.name not in getters:
        raise ValueError(f"fixture {value.name!r} has no value in a rank; the rank "
                         f"fixtures are {list(RANK_FIXTURES)}")
    model_groups = ("tp_group", "pp_group", "dp_group")
    if value.name in model_groups and not ps.model_parallel_is_initialized():
        raise ValueError(f"fixture {value.name!r} needs model-parallel groups: give tp=, pp= "
                         f"or dp= in the distributed marker")
    return getters[value.name]()


def _test_function(call: TestCall) -> tuple[Any, Callable[..., Any]]:
    """The test function of ``call`` and what holds it (its module, or a new instance
    of its test class, to which a method is bound)."""
    __tracebackhide__ = True
    for entry in reversed(call.sys_path):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    obj: Any = _test_module(call.module_name, call.path)
    owner = obj
    parts = call.qualname.split(".")
    for i, name in enumerate(parts):
        owner = obj
        try:
            obj = getattr(obj, name)
        except AttributeError:
            raise LookupError(f"{call.nodeid}: {'.'.join(parts[:i + 1])} is not in module "
                              f"{call.module_name} ({call.path}) as imported in the rank"
                              ) from None
        if isinstance(obj, type) and i < len(parts) - 1:
            obj = obj()  # pytest runs each test method on a new instance of its class
    if not callable(obj):
        raise TypeError(f"{call.nodeid}: {call.qualname} is not callable in the rank")
    return owner, obj


@contextlib.contextmanager
def _xunit_setup(owner: Any, fn: Callable[..., Any]) -> Iterator[None]:
    """pytest's xunit-style setup and teardown of one test, in the rank: the test
    class's ``setup_method``/``teardown_method``, or the module's
    ``setup_function``/``teardown_function`` (teardown only after a setup that
    returned, as pytest does)."""
    __tracebackhide__ = True
    kind = "function" if isinstance(owner, ModuleType) else "method"
    setup = getattr(owner, f"setup_{kind}", None)
    teardown = getattr(owner, f"teardown_{kind}", None)
    if setup is not None:
        setup(fn)
    try:
        yield
    finally:
        if teardown is not None:
            teardown(fn)


def _test_module(name: str, path: str) -> ModuleType:
    """The module ``name`` from file ``path``: already imported, else loaded from the file."""
    mod = sys.modules.get(name)
    if mod is not None and _same_file(getattr(mod, "__file__", None), path):
        return mod
    package = name.rpartition(".")[0]
    if package:
        with contextlib.suppress(ImportError):  # a rootdir-relative name may have none
            importlib.import_module(package)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None:
        raise ImportError(f"cannot import the test module {name} from {path} in the rank")
    mod = importlib.util.module_from_spec(spec)
    code = compile_with_rewritten_asserts(path)
    sys.modules[name] = mod
    try:
        exec(code, mod.__dict__)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return mod


def _same_file(a: str | None, b: str) -> bool:
    if a is None:
        return False
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


@contextlib.contextmanager
def _captured_fds(path: str | None) -> Iterator[list[str]]:
    """Send file descriptors 1 and 2 to the file ``path`` (emptied first; None: a
    temporary file), with ``sys.stdout``/``sys.stderr`` line-buffered; yields a
    list that holds the text written once the block ends."""
    out: list[str] = []
    streams = (sys.stdout, sys.stderr)
    for stream in streams:
        with contextlib.suppress(Exception):
            stream.flush()
    buffering = [getattr(stream, "line_buffering", None) for stream in streams]
    tmp = tempfile.TemporaryFile() if path is None else open(path, "w+b")  # noqa: SIM115
    with tmp:
        saved = (os.dup(1), os.dup(2))
        os.dup2(tmp.fileno(), 1)
        os.dup2(tmp.fileno(), 2)
        for stream in streams:
            with contextlib.suppress(Exception):
                stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        try:
            yield out
        finally:
            for stream, before in zip(streams, buffering, strict=True):
                with contextlib.suppress(Exception):
                    stream.flush()
                    if before is not None:
                        stream.reconfigure(line_buffering=before)  # type: ignore[union-attr]
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            tmp.seek(0)
            out.append(tmp.read().decode("utf-8", errors="replace"))


@contextlib.contextmanager
def _warning_filters(filters: tuple[list[str], list[str], list[str]] | None
                     ) -> Iterator[None]:
    """pytest's warning filters for one test, applied as its warnings plugin applies
    them (:class:`~coordinator.pytest_plugin.protocol.TestCall`'s ``warning_filters``);
    the process's filters are back after the block."""
    if filters is None:
        yield
        return
    ini, cmdline, marks = filters
    with warnings.catch_warnings():
        if not sys.warnoptions:  # pytest shows these by default
            warnings.filterwarnings("always", category=DeprecationWarning)
            warnings.filterwarnings("always", category=PendingDeprecationWarning)
        try:
            from _pytest.config import apply_warning_filters, parse_warning_filter
        except ImportError:  # another pytest: the defaults above only
            yield
            return
        apply_warning_filters(ini, cmdline)
        for arg in marks:
            warnings.filterwarnings(*parse_warning_filter(arg, escape=False))
        yield
