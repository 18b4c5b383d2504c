"""Pasted logs built around real source lines: tracebacks, compiler errors, build output.

What people paste most is a failure: a Python traceback ending in a library
frame, a gcc or rustc diagnostic, a Node stack, a failing make or shell run.
The frames and quoted lines here are the real lines (and line numbers) of the
snippet's file; only the error around them is composed, in each tool's own
format, so the token mix matches what a model sees in real chats.
"""

from __future__ import annotations

import random
import re

from snippets import Snippet

USERS = ("dev", "alex", "mk", "sam", "ubuntu", "runner", "jo", "build")
PROJECTS = ("api", "etl-jobs", "backend", "tools", "service", "pipeline", "app", "infra", "bot", "webapp")


def _code_lines(sn: Snippet) -> list[tuple[int, str]]:
    out = []
    for i, ln in enumerate(sn.text.split("\n")):
        s = ln.strip()
        if s and not re.match(r"(#|//|/\*|\*|\"\"\"|@|def |class |fn |pub fn |function )", s) and len(s) > 6:
            out.append((sn.start_line + i, ln))
    return out or [(sn.start_line, sn.text.split("\n")[0])]


def _words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z_][A-Za-z0-9_]{2,}", text) or ["value"]


def _home(rng: random.Random) -> str:
    return f"/home/{rng.choice(USERS)}/{rng.choice(PROJECTS)}"


def python_log(sn: Snippet, rng: random.Random) -> str:
    lineno, line = rng.choice(_code_lines(sn))
    words = _words(line)
    if "[" in line:
        m = re.search(r"\[([\"']?)(\w+)\1\]", line)
        exc = f"KeyError: '{m.group(2)}'" if m and m.group(1) else "IndexError: list index out of range"
    elif re.search(r"\.\w+", line):
        attr = re.findall(r"\.(\w+)", line)[-1]
        exc = f"AttributeError: 'NoneType' object has no attribute '{attr}'"
    elif "int(" in line or "float(" in line:
        exc = f"ValueError: invalid literal for int() with base 10: '{rng.choice(words)}'"
    else:
        exc = rng.choice([f"TypeError: {sn.name}() got an unexpected keyword argument '{rng.choice(words)}'",
                          "TypeError: unsupported operand type(s) for +: 'int' and 'str'",
                          f"RuntimeError: {rng.choice(words)} failed"])
    home = _home(rng)
    script = rng.choice(["main", "run", "cli", "worker", "app", "job"])
    if rng.random() < 0.3:
        head = ["============================= FAILURES ==============================",
                f"_____________________ test_{sn.name.lower()} _____________________", "",
                f"    def test_{sn.name.lower()}():", f">       {sn.name}({rng.choice(words)})", ""]
        tail = [f"E       {exc}", "", f"{'/usr/lib/python3.11/site-packages/' + sn.path}:{lineno}: {exc.split(':')[0]}",
                "=========================== short test summary info ============================",
                f"FAILED tests/test_{script}.py::test_{sn.name.lower()} - {exc}", f"========================= 1 failed, {rng.randint(3, 80)} passed in {rng.uniform(0.3, 9):.2f}s ========================="]
        return "\n".join(head + [f"    {ln}" for ln in sn.text.split("\n")[:12]] + tail)
    frames = ["Traceback (most recent call last):",
              f'  File "{home}/{script}.py", line {rng.randint(20, 300)}, in <module>', "    main()",
              f'  File "{home}/{script}.py", line {rng.randint(5, 200)}, in main',
              f"    result = {sn.name}({', '.join(rng.sample(words, min(2, len(words))))})",
              f'  File "/usr/lib/python3.11/site-packages/{sn.path}", line {lineno}, in {sn.name}', f"    {line.strip()}", exc]
    return "\n".join(frames)


def c_log(sn: Snippet, rng: random.Random) -> str:
    lineno, line = rng.choice(_code_lines(sn))
    tok = rng.choice(_words(line))
    col = max(1, line.find(tok) + 1)
    msg = rng.choice([f"unknown type name '{tok}'", f"'{tok}' undeclared (first use in this function)",
                      f"expected ';' before '{tok}'", f"implicit declaration of function '{tok}' [-Wimplicit-function-declaration]",
                      "comparison of integer expressions of different signedness [-Wsign-compare]"])
    unit = rng.choice(["main", "module", "ext", "bindings", "kernel", "wrapper"])
    if rng.random() < 0.25:
        return "\n".join([f"/usr/bin/ld: build/{unit}.o: in function `{unit}_init':",
                          f"{unit}.c:(.text+0x{rng.randint(16, 4095):x}): undefined reference to `{sn.name}'",
                          f"/usr/bin/ld: {unit}.c:(.text+0x{rng.randint(16, 4095):x}): undefined reference to `{rng.choice(_words(sn.text))}'",
                          "collect2: error: ld returned 1 exit status", f"make: *** [Makefile:{rng.randint(10, 90)}: {unit}] Error 1"])
    return "\n".join([f"gcc -O2 -Wall -Iinclude -c src/{unit}.c -o build/{unit}.o",
                      f"In file included from src/{unit}.c:{rng.randint(2, 20)}:",
                      f"{sn.path}:{lineno}:{col}: error: {msg}", f" {lineno:>4} | {line}", f"      | {' ' * (col - 1)}^{'~' * (len(tok) - 1)}",
                      f"make: *** [Makefile:{rng.randint(10, 90)}: build/{unit}.o] Error 1"])


def rust_log(sn: Snippet, rng: random.Random) -> str:
    lineno, line = rng.choice(_code_lines(sn))
    tok = rng.choice(_words(line))
    col = max(1, line.find(tok) + 1)
    if rng.random() < 0.35:
        return "\n".join([f"thread 'main' panicked at library/{sn.path}:{lineno}:{col}:",
                          rng.choice(["called `Option::unwrap()` on a `None` value", "index out of bounds: the len is 0 but the index is 0",
                                      "attempt to subtract with overflow", f"called `Result::unwrap()` on an `Err` value: {tok}"]),
                          "stack backtrace:", "   0: rust_begin_unwind", "   1: core::panicking::panic_fmt",
                          f"   2: {sn.path.split('/')[0]}::{sn.name}", f"             at ./library/{sn.path}:{lineno}:{col}",
                          f"   3: {rng.choice(PROJECTS).replace('-', '_')}::main",
                          "note: Some details are omitted, run with `RUST_BACKTRACE=full` for a verbose backtrace."])
    code, msg, label = rng.choice([("E0308", "mismatched types", "expected `usize`, found `i32`"),
                                   ("E0502", f"cannot borrow `{tok}` as mutable because it is also borrowed as immutable", "mutable borrow occurs here"),
                                   ("E0382", f"borrow of moved value: `{tok}`", "value borrowed here after move"),
                                   ("E0599", f"no method named `{tok}` found in the current scope", "method not found")])
    return "\n".join([f"   Compiling {rng.choice(PROJECTS)} v0.{rng.randint(1, 9)}.{rng.randint(0, 20)}", f"error[{code}]: {msg}",
                      f"  --> src/{sn.path.split('/')[-1]}:{lineno}:{col}", "   |", f"{lineno:<3}| {line}",
                      f"   | {' ' * (col - 1)}{'^' * max(1, len(tok))} {label}", "",
                      f"For more information about this error, try `rustc --explain {code}`.",
                      f"error: could not compile `{rng.choice(PROJECTS)}` (lib) due to 1 previous error"])


def js_log(sn: Snippet, rng: random.Random) -> str:
    lineno, line = rng.choice(_code_lines(sn))
    props = re.findall(r"\.(\w+)", line) or _words(line)
    prop = rng.choice(props)
    col = max(1, line.find(prop) + 1)
    path = f"/usr/lib/node_modules/{sn.path}"
    return "\n".join([f"{path}:{lineno}", f"{line}", f"{' ' * (col - 1)}^", "",
                      rng.choice([f"TypeError: Cannot read properties of undefined (reading '{prop}')",
                                  f"ReferenceError: {prop} is not defined", f"TypeError: {prop} is not a function"]),
                      f"    at {sn.name} ({path}:{lineno}:{col})",
                      f"    at Object.<anonymous> ({_home(rng)}/index.js:{rng.randint(3, 120)}:{rng.randint(3, 40)})",
                      "    at Module._compile (node:internal/modules/cjs/loader:1554:14)",
                      "    at Object..js (node:internal/modules/cjs/loader:1706:10)", "", "Node.js v22.12.0"])


def ops_log(sn: Snippet, rng: random.Random) -> str:
    lines = [ln for ln in sn.text.split("\n") if ln.strip() and not ln.lstrip().startswith("#")] or [sn.text.split("\n")[0]]
    name = sn.path.split("/")[-1]
    k = rng.randrange(len(lines))
    at = sn.start_line + sn.text.split("\n").index(lines[k]) if lines[k] in sn.text.split("\n") else sn.start_line
    col = rng.randint(3, 30)
    if name.endswith((".yaml", ".yml")):
        return "\n".join([f"$ python -c 'import yaml; yaml.safe_load(open(\"{name}\"))'", "Traceback (most recent call last):",
                          '  File "<string>", line 1, in <module>', "yaml.scanner.ScannerError: mapping values are not allowed here",
                          f'  in "{name}", line {at}, column {col}', f"    {lines[k].strip()}"])
    if name.endswith(".json"):
        return "\n".join([f"$ jq . {name}", f"jq: error (at {name}:{at}): Cannot index string with string \"{sn.name}\"",
                          f"$ node -e 'require(\"./{name}\")'", f"SyntaxError: {name}: Unexpected token '}}', \"{lines[k].strip()[:40]}\" is not valid JSON"])
    if name.endswith(".toml"):
        return "\n".join(["$ cargo build", f"error: failed to parse manifest at `{_home(rng)}/{name}`", "", "Caused by:",
                          f"  TOML parse error at line {at}, column {col}", "   |", f"{at:>2} | {lines[k]}", f"   | {' ' * col}^",
                          "  invalid table header"])
    if name.endswith((".ini", ".cfg", ".conf")):
        return "\n".join(["Traceback (most recent call last):", f'  File "{_home(rng)}/setup.py", line 3, in <module>',
                          "configparser.ParsingError: Source contains parsing errors: " + repr(name), f"\t[line {at:>2}]: {lines[k].strip()!r}"])
    if name in ("Makefile", "GNUmakefile") or name.endswith(".mk"):
        targets = re.findall(r"^([\w.-]+):", sn.text, re.M) or ["all"]
        recipe = [ln.strip() for ln in lines if ln.startswith("\t")][:3] or lines[:2]
        return "\n".join([f"make[1]: Entering directory '{_home(rng)}/build'"] + recipe +
                         [f"make[1]: *** [{name}:{at}: {rng.choice(targets)}] Error {rng.choice([1, 2, 127])}",
                          f"make[1]: Leaving directory '{_home(rng)}/build'", "make: *** [all] Error 2"])
    traced = [f"+ {ln.strip()}" for ln in lines[: rng.randint(2, 8)]]
    cmd = rng.choice(_words(lines[min(len(traced), len(lines)) - 1]))
    return "\n".join([f"$ bash -x ./{name}"] + traced + [rng.choice([f"./{name}: line {sn.start_line + len(traced)}: {cmd}: command not found",
                                                                       f"./{name}: line {sn.start_line + len(traced)}: {cmd}: No such file or directory",
                                                                       f"error: {cmd} exited with status {rng.choice([1, 2, 126, 127])}"])])


LOGGERS = {"code-python": python_log, "code-c": c_log, "code-rust": rust_log, "code-js": js_log, "ops": ops_log}


def log_for(sn: Snippet, rng: random.Random) -> str | None:
    fn = LOGGERS.get(sn.domain)
    return fn(sn, rng) if fn else None
