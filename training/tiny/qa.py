"""Question/answer pairs about the standard library, built from its own docstrings and signatures.

The chat fine-tune of kestrel-tiny (`training.tiny.finetune`) trains on these: "What does `os.path.join` do?"
is answered with the signature line and the first paragraph of the docstring. Everything comes from the
running interpreter's stdlib source, parsed with `ast` (nothing is imported, so no module's import side
effects run and the result is the same on any machine with the same stdlib).

Honesty of the held-out perplexity: pairs are built only from train-split files (`corpus.train_files()`),
and a pair is dropped when its docstring also appears, cleaned the same way, in an eval-split file (some
functions are copied between modules, e.g. pure-Python twins of C modules), so no held-out text reaches
the fine-tune through a copy either.

Torch-free; deterministic: files in sorted path order, definitions in source order, phrasings in a fixed
order (shuffling is the trainer's job, with its own seed).
"""

from __future__ import annotations

import ast
import copy
import functools
import re
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kestrel.tiny import corpus

# Directories (any path component) and file name prefixes whose definitions make no useful questions:
# the stdlib's own test suites, their fixtures and demo scripts.
SKIPPED_DIRS = frozenset({"test", "tests", "idle_test", "turtledemo"})
SKIPPED_PREFIXES = ("test_",)
# Other public names a module is used under (on POSIX, `os.path` is `posixpath`).
MODULE_ALIASES: dict[str, tuple[str, ...]] = {"posixpath": ("os.path",)}
MAX_ANSWER_CHARS = 400
MAX_SIGNATURE_CHARS = 160
MIN_DOC_CHARS = 12

FUNCTION_QUESTIONS = ("What does `{name}` do?", "How do I use `{name}`?", "What is the signature of `{name}`?")
CLASS_QUESTIONS = ("What is `{name}`?", "How do I use `{name}`?", "What is the signature of `{name}`?")


@dataclass(frozen=True)
class QAPair:
    question: str
    answer: str
    name: str  # dotted public name, e.g. "os.path.join" or "json.JSONDecoder.decode"
    kind: str  # "function", "class" or "method"
    source: str  # the relative POSIX path of the stdlib file it was built from

    def messages(self) -> list[dict[str, str]]:
        """The conversation of this pair (user question, assistant answer) for a chat template."""
        return [{"role": "user", "content": self.question}, {"role": "assistant", "content": self.answer}]


@dataclass(frozen=True)
class Definition:
    name: str
    kind: str
    signature: str
    docstring: str  # cleaned by ast.get_docstring
    source: str


# ------------------------------------------------------------------------------------------------ modules


def module_name(rel: str) -> str | None:
    """The dotted module name of a relative stdlib path, or None when it is private, a test or a script.

    "json/decoder.py" -> "json.decoder", "json/__init__.py" -> "json"; "_pyio.py", "test/test_os.py",
    "json/__main__.py" -> None.
    """
    parts = rel[:-3].split("/") if rel.endswith(".py") else None
    if not parts:
        return None
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if not parts or parts[-1] == "__main__":
        return None
    if any(p.startswith("_") or p in SKIPPED_DIRS or not p.isidentifier() for p in parts):
        return None
    if parts[-1].startswith(SKIPPED_PREFIXES):
        return None
    return ".".join(parts)


def parse(text: str, rel: str) -> ast.Module | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences in old files, etc.
            return ast.parse(text, filename=rel)
    except (SyntaxError, ValueError):
        return None  # lib2to3 fixtures with Python 2 syntax, files with NUL bytes


# ------------------------------------------------------------------------------------------------ definitions


def _static_all(tree: ast.Module) -> set[str] | None:
    """The names in a literal `__all__ = [...]` (or tuple), or None when there is none to read statically."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                return None
            if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
                return set(value)
            return None
    return None


def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements of a module or class body, looking into `if`/`try` blocks (platform-dependent definitions)."""
    for node in body:
        if isinstance(node, ast.If):
            yield from _top_level(node.body)
            yield from _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            yield from _top_level(node.body)
            for handler in node.handlers:
                yield from _top_level(handler.body)
            yield from _top_level(node.orelse)
        else:
            yield node


def _decorator_names(node: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    names = set()
    for d in node.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if isinstance(target, ast.Name):
            names.add(target.id)
        elif isinstance(target, ast.Attribute):
            names.add(target.attr)
    return names


def _without_first_positional(args: ast.arguments) -> ast.arguments:
    """A copy of `args` without `self` / `cls` (the first positional parameter)."""
    args = copy.deepcopy(args)
    positional = len(args.posonlyargs) + len(args.args)
    if positional == 0:
        return args
    if len(args.defaults) == positional:  # every positional has a default: the first one's goes too
        args.defaults = args.defaults[1:]
    if args.posonlyargs:
        args.posonlyargs = args.posonlyargs[1:]
    else:
        args.args = args.args[1:]
    return args


def signature(name: str, node: ast.FunctionDef | ast.AsyncFunctionDef | None, method: bool) -> str:
    """`name(parameters) -> return` as written in the source (annotations and defaults kept).

    For a method (and for a class, whose parameters are its `__init__`'s) the first parameter is left out,
    unless the method is a staticmethod. Defaults too long to be useful are shortened to `...`.
    """
    if node is None:
        return f"{name}()"
    args = node.args
    if method and "staticmethod" not in _decorator_names(node):
        args = _without_first_positional(args)
    args = copy.deepcopy(args)
    for i, default in enumerate(args.defaults):
        if len(ast.unparse(default)) > 40:
            args.defaults[i] = ast.Constant(...)
    for i, default in enumerate(args.kw_defaults):
        if default is not None and len(ast.unparse(default)) > 40:
            args.kw_defaults[i] = ast.Constant(...)
    params = ast.unparse(args)
    returns = f" -> {ast.unparse(node.returns)}" if node.returns is not None and node.name != "__init__" else ""
    if len(name) + len(params) + len(returns) + 2 > MAX_SIGNATURE_CHARS:
        # Keep the leading parameters that fit, cut at a top-level comma, and say that more follow.
        room = max(0, MAX_SIGNATURE_CHARS - len(name) - len(returns) - 7)
        cuts = [i for i in _top_level_commas(params) if i <= room]
        params = (params[: cuts[-1]] + ", ...") if cuts else "..."
    return f"{name}({params}){returns}"


def _top_level_commas(params: str) -> list[int]:
    """Positions of the commas of `params` that separate parameters (not inside brackets or strings)."""
    depth, quote, out = 0, "", []
    for i, ch in enumerate(params):
        if quote:
            if ch == quote and params[i - 1] != "\\":
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(i)
    return out


def _docstring(node: ast.AST) -> str | None:
    try:
        doc = ast.get_docstring(node, clean=True)  # type: ignore[arg-type]
    except TypeError:
        return None
    if doc is None or len(doc.strip()) < MIN_DOC_CHARS:
        return None
    return doc.strip()


def _init_of(cls: ast.ClassDef) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    for node in _top_level(cls.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "__init__":
            return node
    return None


def _is_property(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    names = _decorator_names(node)
    return bool(names & {"property", "cached_property", "setter", "getter", "deleter", "overload"})


def definitions(tree: ast.Module, module: str, source: str) -> list[Definition]:
    """Public functions, classes and their public methods that have a docstring, in source order.

    Public: no leading underscore, and in `__all__` when the module lists its names literally (methods of a
    listed class count). The first definition of a name wins (the others are platform variants).
    """
    public = _static_all(tree)
    found: dict[str, Definition] = {}

    def add(name: str, kind: str, sig: str, doc: str | None) -> None:
        if doc is not None and name not in found:
            found[name] = Definition(name, kind, sig, doc, source)

    for node in _top_level(tree.body):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if node.name.startswith("_") or (public is not None and node.name not in public):
            continue
        qualified = f"{module}.{node.name}"
        if isinstance(node, ast.ClassDef):
            init = _init_of(node)
            add(qualified, "class", signature(qualified, init, method=True), _docstring(node))
            for member in _top_level(node.body):
                if (isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)) and not member.name.startswith("_")
                        and not _is_property(member)):
                    name = f"{qualified}.{member.name}"
                    add(name, "method", signature(name, member, method=True), _docstring(member))
        elif "overload" not in _decorator_names(node):
            add(qualified, "function", signature(qualified, node, method=False), _docstring(node))
    return list(found.values())


# ------------------------------------------------------------------------------------------------ answers


def first_paragraph(doc: str, max_chars: int = MAX_ANSWER_CHARS) -> str:
    """The docstring's first paragraph on one line, cut at a sentence (or word) end within max_chars."""
    paragraph = re.split(r"\n\s*\n", doc.strip(), maxsplit=1)[0]
    text = " ".join(paragraph.split())
    if len(text) <= max_chars:
        return text
    cut = text[:max_chars]
    sentence_end = max(cut.rfind(". "), cut.rfind("! "), cut.rfind("? "))
    if sentence_end >= max_chars // 3:
        return cut[: sentence_end + 1]
    return cut.rsplit(" ", 1)[0].rstrip(",;:") + " ..."


def first_sentence(text: str) -> str:
    match = re.search(r"[.!?](\s|$)", text)
    return text if match is None else text[: match.start() + 1]


def pairs_for(d: Definition, max_answer_chars: int = MAX_ANSWER_CHARS) -> list[QAPair]:
    """The questions about one definition: what it does / how to use it (signature + first paragraph),
    and its signature (signature + first sentence)."""
    paragraph = first_paragraph(d.docstring, max_answer_chars)
    full = f"{d.signature}\n\n{paragraph}"
    short = f"{d.signature}\n\n{first_sentence(paragraph)}"
    questions = CLASS_QUESTIONS if d.kind == "class" else FUNCTION_QUESTIONS
    answers = (full, full, short)
    return [QAPair(q.format(name=d.name), a, d.name, d.kind, d.source) for q, a in zip(questions, answers)]


def _aliased(d: Definition, module: str) -> Iterator[Definition]:
    yield d
    for alias in MODULE_ALIASES.get(module, ()):
        name = alias + d.name[len(module):]
        yield Definition(name, d.kind, alias + d.signature[len(module):], d.docstring, d.source)


def eval_docstrings(root: Path | None = None) -> frozenset[str]:
    """Every cleaned docstring (modules, classes, functions) of the eval-split files."""
    return _eval_docstrings(tuple(corpus.eval_files(root)))


@functools.lru_cache(maxsize=4)
def _eval_docstrings(files: tuple[corpus.SourceFile, ...]) -> frozenset[str]:
    found: set[str] = set()
    for f, text in corpus.iter_texts(list(files)):
        tree = parse(text, f.rel)
        if tree is None:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = _docstring(node)
                if doc is not None:
                    found.add(doc)
    return frozenset(found)


def build_pairs(files: Iterable[corpus.SourceFile] | None = None, root: Path | None = None,
                max_answer_chars: int = MAX_ANSWER_CHARS) -> list[QAPair]:
    """QA pairs from `files` (default: the whole train split under `root`), in a fixed order.

    Files of the eval split are refused (ValueError) rather than skipped, so a caller's mistake is loud;
    private modules, tests and scripts give no pairs (`module_name`).
    """
    chosen = list(corpus.train_files(root) if files is None else files)
    held_out = [f.rel for f in chosen if corpus.is_eval_path(f.rel)]
    if held_out:
        raise ValueError(f"QA pairs must come from the train split only; got eval-split files {held_out[:5]}")
    held_out_docs = eval_docstrings(root if root is not None else (chosen[0].root if chosen else None))
    pairs: list[QAPair] = []
    seen: set[str] = set()
    for f in sorted(chosen, key=lambda f: f.rel):
        module = module_name(f.rel)
        if module is None:
            continue
        text = f.read()
        tree = parse(text, f.rel) if text else None
        if tree is None:
            continue
        for d in definitions(tree, module, f.rel):
            if d.docstring in held_out_docs:
                continue
            for variant in _aliased(d, module):
                if variant.name not in seen:
                    seen.add(variant.name)
                    pairs.extend(pairs_for(variant, max_answer_chars))
    return pairs


__all__ = ["QAPair", "build_pairs", "definitions", "eval_docstrings", "first_paragraph", "module_name",
           "pairs_for", "signature"]
