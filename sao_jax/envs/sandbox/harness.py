"""The `code_tests` harness: reference tests call a solution across a process boundary.

Standard library only and self-contained: the sandbox's child program (child.py) runs
this source text in two processes of one sandbox run, and the host imports it to count
the tests of a test source (`count_tests`). Layout (docs/sandbox.md, "Reward hacking"):

    supervisor
      ├─ worker (untrusted)  imports the solution (`runpy.run_path(..., run_name=
      │                      "solution")`: its `if __name__ == "__main__":` block does not
      │                      run), then `serve`s requests on a pipe pair
      └─ tests (trusted)     forked after the worker; reads the test source and the run's
                             secret from a memfd only it has, runs each top-level test
                             statement with the solution's names bound to `Remote`
                             proxies, writes the verdict with the secret on a pipe only
                             it holds (`run_tests`)

Values cross as a tagged JSON of builtin types, each checked by its exact type
(`type(x) is int`, never isinstance: an `int` subclass with an always-true `__eq__` does
not pass for an int); anything else stays in the worker and crosses as an opaque handle,
a `Remote` whose `__eq__` is identity and whose truth value is an error. The tests'
`==`, `!=`, `in`, `not in` are rewritten into `strict_compare` (type-strict: `1 != 1.0`,
`True != 1`, containers element by element). A test passes when its statement ran to
the end, no call of it lost the solution's process or got a malformed reply (even if the
test caught the exception), and every assert held.

Wire format: 4-byte big-endian length + JSON. Requests `{"op": ..., "h": handle, ...}`;
replies `{"ok": value}` (a call adds `"after"`: the top-level list/dict/set arguments as
the call left them, so in-place mutation is seen) or `{"raise": [type name, message]}`.
"""

import ast
import base64
import builtins
import contextlib
import json
import os
import sys

MAX_MESSAGE = 16 << 20  # bytes of one request or reply
MAX_DEPTH = 100  # nesting of one value
MAX_ITER = 100_000  # items `iter` / `list()` of a solution object may yield
MAX_FAILURES = 20  # failure messages in a verdict (every test's pass/fail is kept)
SETUP_NODES = (
    ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom,
    ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Pass, ast.Global, ast.Nonlocal, ast.Delete,
)  # fmt: skip
BUILTIN_NAMES = frozenset(dir(builtins))  # never bound to a solution's name


class SolutionGone(BaseException):
    """The solution's process ended or sent a malformed reply."""  # a test cannot hide it)


class SolutionError(RuntimeError):
    """The solution raised an exception that is not a builtin one."""


# ---- values ------------------------------------------------------------------------------


def encode(x, handle, depth=0):
    """`x` as tagged JSON; a value of any other than the builtin types goes through
    `handle(obj) -> {"h": id}` (which may raise TypeError to refuse it)."""
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deep (or cyclic)")
    t = type(x)
    if x is None or t is bool or t is str:
        return x
    if t is int:
        return {"i": hex(x)}  # base 16: no digit limit
    if t is float:
        return {"f": x.hex()}
    if t is complex:
        return {"c": [x.real.hex(), x.imag.hex()]}
    if t is bytes:
        return {"b": base64.b64encode(x).decode()}
    tags = {list: "l", tuple: "t", set: "s", frozenset: "fs"}
    if t in tags:
        return {tags[t]: [encode(e, handle, depth + 1) for e in x]}
    if t is dict:
        items = [[encode(k, handle, depth + 1), encode(v, handle, depth + 1)] for k, v in x.items()]
        return {"d": items}
    return handle(x)


def decode(v, remote, depth=0):
    """The value tagged JSON `v` stands for; `remote(id)` turns a handle into an object.
    Anything malformed raises ValueError (TypeError for an unhashable set element)."""
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deep")
    if v is None or type(v) is bool or type(v) is str:
        return v
    if type(v) is not dict or len(v) != 1:
        raise ValueError(f"malformed value {str(v)[:80]!r}")
    ((tag, body),) = v.items()
    if tag == "h" and type(body) is int:
        return remote(body)
    if tag in ("i", "f", "b") and type(body) is not str:
        raise ValueError(f"malformed {tag!r} value")
    if tag == "i":
        return int(body, 16)
    if tag == "f":
        return float.fromhex(body)
    if tag == "b":
        return base64.b64decode(body, validate=True)
    if type(body) is not list:
        raise ValueError(f"malformed {tag!r} value")
    if tag == "c" and len(body) == 2 and all(type(p) is str for p in body):
        return complex(float.fromhex(body[0]), float.fromhex(body[1]))
    items = lambda: [decode(e, remote, depth + 1) for e in body]
    if tag == "l":
        return items()
    if tag == "t":
        return tuple(items())
    if tag == "s":
        return set(items())
    if tag == "fs":
        return frozenset(items())
    if tag == "d":
        if not all(type(p) is list and len(p) == 2 for p in body):
            raise ValueError("malformed dict value")
        return {decode(k, remote, depth + 1): decode(w, remote, depth + 1) for k, w in body}
    raise ValueError(f"unknown value tag {tag!r}")


def send(fd, message) -> None:
    data = json.dumps(message, ensure_ascii=True, allow_nan=False).encode()
    if len(data) > MAX_MESSAGE:
        raise ValueError(f"message of {len(data)} bytes > {MAX_MESSAGE}")
    data = len(data).to_bytes(4, "big") + data
    while data:
        data = data[os.write(fd, data) :]


def _read_exactly(fd, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 16))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def recv(fd):
    """The next message, or None at end of file; ValueError if it is malformed."""
    head = _read_exactly(fd, 4)
    if head is None:
        return None
    n = int.from_bytes(head, "big")
    if n > MAX_MESSAGE:
        raise ValueError(f"message of {n} bytes > {MAX_MESSAGE}")
    data = _read_exactly(fd, n)
    if data is None:
        raise ValueError("message cut short")
    return json.loads(data)


# ---- the worker side (untrusted: runs the solution) --------------------------------------


def serve(req_fd: int, resp_fd: int, path: str) -> None:
    """Imports the solution at `path`, then answers requests until end of file; exits."""
    import runpy
    import traceback

    table = [None]  # handle -> object

    def handle(obj):
        table.append(obj)
        return {"h": len(table) - 1}

    def value(obj):
        try:
            return encode(obj, handle)
        except (ValueError, RecursionError):
            return handle(obj)

    try:
        names = runpy.run_path(path, run_name="solution")
        failed = None
    except BaseException as e:  # reported to every request; the traceback to stderr
        traceback.print_exc()
        names, failed = {}, [type(e).__name__, "the solution raised on import: " + _text(e)]

    def answer(msg):
        if failed is not None:
            return {"raise": failed}
        op = msg["op"]
        if op == "names":
            pairs = [{"t": [k, value(v)]} for k, v in names.items() if not k.startswith("_")]
            return {"ok": {"l": pairs}}
        target = table[msg["h"]] if 0 < msg["h"] < len(table) else None
        arg = lambda v: decode(v, lambda h: table[h])
        if op == "call":
            args = [arg(a) for a in msg["args"]]
            kwargs = {k: arg(v) for k, v in msg["kwargs"]}
            out = value(target(*args, **kwargs))
            after = [[i, value(a)] for i, a in enumerate(args) if type(a) in (list, dict, set)]
            after += [[k, value(a)] for k, a in kwargs.items() if type(a) in (list, dict, set)]
            return {"ok": out, "after": after}
        if op == "getattr":
            return {"ok": value(getattr(target, msg["name"]))}
        if op == "getitem":
            return {"ok": value(target[arg(msg["key"])])}
        if op == "contains":
            return {"ok": value(arg(msg["item"]) in target)}
        if op == "len":
            return {"ok": value(len(target))}
        if op == "iter":
            items = []
            for item in target:
                if len(items) >= MAX_ITER:
                    raise ValueError(f"more than {MAX_ITER} items")
                items.append(item)
            return {"ok": value(items)}
        if op in ("str", "repr"):
            return {"ok": value((str if op == "str" else repr)(target))}
        raise ValueError(f"unknown request {op!r}")

    while True:
        try:
            msg = recv(req_fd)
        except (ValueError, OSError):
            msg = None
        if msg is None:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(BaseException):
                    stream.flush()
            os._exit(0)
        try:
            reply = answer(msg)
        except BaseException as e:
            reply = {"raise": [type(e).__name__, _text(e)]}
        try:
            send(resp_fd, reply)
        except (ValueError, TypeError):
            send(resp_fd, {"raise": ["ValueError", "the reply cannot be sent"]})


def _text(e: BaseException) -> str:
    try:
        return str(e)[:300]
    except BaseException:
        return "(unprintable)"


# ---- the tests side (trusted) ------------------------------------------------------------


class Connection:
    """The tests' end of the pipe pair; `failed` is set by any transport failure."""

    def __init__(self, req_fd: int, resp_fd: int):
        self.req_fd, self.resp_fd = req_fd, resp_fd
        self.gone: str | None = None  # why the solution cannot answer any more
        self.failed = False  # a transport failure during the current test statement

    def ask(self, msg):
        """The reply's value (and the call's `after` list); raises the solution's
        exception (as a builtin type, or SolutionError) or SolutionGone."""
        if self.gone is None:
            error = None
            try:
                send(self.req_fd, msg)
                reply = recv(self.resp_fd)
                if reply is None:
                    self.gone = "the solution's process ended (it exited, crashed or hit a limit)"
                elif type(reply) is not dict:
                    raise ValueError("reply is not an object")
                elif "raise" in reply:
                    error = _exception(reply["raise"])
                else:
                    out = decode(reply["ok"], lambda h: Remote(self, h))
                    after = [
                        (k, decode(v, lambda h: Remote(self, h))) for k, v in reply.get("after", [])
                    ]
                    return out, after
            except (OSError, ValueError, TypeError, KeyError, RecursionError) as e:
                self.gone = f"malformed reply from the solution ({type(e).__name__}: {e})"
            if error is not None:
                raise error
        self.failed = True
        raise SolutionGone(self.gone)

    def value(self, msg):
        return self.ask(msg)[0]


def _exception(spec) -> BaseException:
    if type(spec) is not list or len(spec) != 2 or not all(type(s) is str for s in spec):
        raise ValueError("malformed exception")
    name, message = spec
    cls = getattr(builtins, name, None)
    is_builtin = isinstance(cls, type) and issubclass(cls, Exception) and cls is not AssertionError
    if is_builtin:
        try:
            return cls(message)
        except Exception:
            pass
    return SolutionError(f"{name}: {message}")


def _arg(x):
    def refuse(obj):
        if type(obj) is Remote:
            return {"h": obj._h}
        raise TypeError(f"cannot pass a {type(obj).__name__} to the solution")

    return encode(x, refuse)


class Remote:
    """An object of the solution's process, seen from the tests."""

    __slots__ = ("_conn", "_h")

    def __init__(self, conn: Connection, h: int):
        object.__setattr__(self, "_conn", conn)
        object.__setattr__(self, "_h", h)

    def __call__(self, *args, **kwargs):
        msg = dict(op="call", h=self._h, args=[_arg(a) for a in args])
        msg["kwargs"] = [[k, _arg(v)] for k, v in kwargs.items()]
        out, after = self._conn.ask(msg)
        for key, new in after:  # in-place changes of list/dict/set arguments
            old = args[key] if type(key) is int and key < len(args) else kwargs.get(key)
            if type(old) is type(new) and type(new) is list:
                old[:] = new
            elif type(old) is type(new) and type(new) in (dict, set):
                old.clear()
                old.update(new)
        return out

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._conn.value(dict(op="getattr", h=self._h, name=name))

    def __getitem__(self, key):
        return self._conn.value(dict(op="getitem", h=self._h, key=_arg(key)))

    def __contains__(self, item):
        out = self._conn.value(dict(op="contains", h=self._h, item=_arg(item)))
        if type(out) is not bool:
            raise TypeError("__contains__ of a solution object did not give a bool")
        return out

    def __len__(self):
        out = self._conn.value(dict(op="len", h=self._h))
        if type(out) is not int or out < 0:
            raise TypeError("len() of a solution object is not a non-negative int")
        return out

    def __iter__(self):
        out = self._conn.value(dict(op="iter", h=self._h))
        if type(out) is not list:
            raise TypeError("iterating a solution object did not give items")
        return iter(out)

    def __str__(self):
        out = self._conn.value(dict(op="str", h=self._h))
        if type(out) is not str:
            raise TypeError("str() of a solution object is not a str")
        return out

    def __repr__(self):
        return f"<solution object #{self._h}>"

    def __bool__(self):
        raise TypeError("a solution object has no truth value in tests (compare it instead)")

    def __eq__(self, other):
        return type(other) is Remote and other._h == self._h

    def __ne__(self, other):
        return not self.__eq__(other)

    def __hash__(self):
        return hash(("solution object", self._h))

    def __setattr__(self, name, value):
        raise TypeError("setting attributes of a solution object is not supported")


def _key(x):
    """A hashable key equal for two values iff they are strictly equal (types included)."""
    t = type(x)
    if t is tuple:
        return (t, tuple(_key(e) for e in x))
    if t is frozenset:
        return (t, frozenset(_key(e) for e in x))
    return (t, x)


def strict_equal(a, b, depth: int = 0) -> bool:
    """`a == b` with every type equal, recursively (1 != 1.0 != True, [1] != (1,))."""
    if depth > MAX_DEPTH:
        raise RecursionError("strict_equal: nested too deep")
    t = type(a)
    if t is not type(b):
        return False
    if t is list or t is tuple:
        return len(a) == len(b) and all(strict_equal(x, y, depth + 1) for x, y in zip(a, b))
    if t is dict:
        if {_key(k) for k in a} != {_key(k) for k in b}:
            return False
        return all(strict_equal(v, b[k], depth + 1) for k, v in a.items())
    if t is set or t is frozenset:
        return {_key(e) for e in a} == {_key(e) for e in b}
    return bool(a == b)


def strict_contains(item, container) -> bool:
    t = type(container)
    if t is list or t is tuple:
        return any(strict_equal(item, e) for e in container)
    if t in (set, frozenset, dict):
        return _key(item) in {_key(e) for e in container}
    if t is str or t is bytes:
        return type(item) is t and item in container
    return item in container


_OPS = {ast.Eq: "==", ast.NotEq: "!=", ast.In: "in", ast.NotIn: "not in"}


def strict_compare(ops: tuple, *operands) -> bool:
    """A chain `a op1 b op2 c ...` of ==, !=, in, not in, each type-strict."""
    for op, a, b in zip(ops, operands, operands[1:]):
        if op == "==":
            ok = strict_equal(a, b)
        elif op == "!=":
            ok = not strict_equal(a, b)
        elif op == "in":
            ok = strict_contains(a, b)
        else:
            ok = not strict_contains(a, b)
        if not ok:
            return False
    return True


class _Strict(ast.NodeTransformer):
    """Rewrites every chain of ==, !=, in, not in into a `__sao_compare__` call."""

    def visit_Compare(self, node):
        self.generic_visit(node)
        if not all(type(op) in _OPS for op in node.ops):
            return node
        ops = ast.Constant(tuple(_OPS[type(op)] for op in node.ops))
        call = ast.Call(
            ast.Name("__sao_compare__", ast.Load()), [ops, node.left, *node.comparators], []
        )
        return ast.copy_location(call, node)


def is_test(stmt) -> bool:
    """A top-level statement that tests (an assert, a call, a loop, ...), not setup (a
    def, an import, an assignment) and not a docstring."""
    if isinstance(stmt, SETUP_NODES):
        return False
    return not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant))


def count_tests(source: str) -> int:
    """The number of test statements of `source` (SyntaxError when it does not parse)."""
    return sum(is_test(s) for s in ast.parse(source).body)


def run_tests(source: str, conn: Connection) -> dict:
    """Runs every top-level statement of `source` in order, with the solution's public
    names bound (builtin names excepted); the verdict dict."""
    statements = ast.parse(source).body
    g = {"__name__": "__tests__", "__builtins__": builtins, "__sao_compare__": strict_compare}
    failures, results = [], []
    try:
        names = conn.value({"op": "names"})
        for name, value in names:
            if name.isidentifier() and name not in BUILTIN_NAMES and not name.startswith("_"):
                g[name] = value
    except BaseException as e:
        failures.append(f"binding the solution's names: {_describe(e)}")
    module = type(sys)("solution")
    module.__dict__.update({k: v for k, v in g.items() if type(v) is Remote})
    sys.modules["solution"] = module  # `from solution import f` in the tests
    for stmt in statements:
        tree = ast.fix_missing_locations(_Strict().visit(ast.Module([stmt], [])))
        conn.failed = False
        try:
            exec(compile(tree, "<tests>", "exec"), g)
            error = None
        except BaseException as e:
            error = _describe(e)
        if conn.failed and error is None:
            error = f"SolutionGone: {conn.gone}"
        if is_test(stmt):
            results.append(error is None)
        if error is not None and len(failures) < MAX_FAILURES:
            failures.append(f"line {stmt.lineno}: {error}"[:300])
    passes = "".join("1" if ok else "0" for ok in results)  # one byte a test
    return {"complete": True, "total": len(results), "passed": sum(results),
            "results": passes, "failures": failures}  # fmt: skip


def _describe(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
