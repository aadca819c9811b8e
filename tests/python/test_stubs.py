"""The type stubs (python/tensorshare/*.pyi) against the package itself: every public method and
property of the documented classes has a stub, every stub names a real one, and the parameter
names of each stub are the ones the method accepts.

The C methods have no inspect.signature, so their parameters are checked by calling them: the
stub's parameters are passed (positional-only ones by position, the others by keyword) with a
value every argument parser converts (a str that is also an int and a float). A method whose
parameters are the stub's binds them and then fails for another reason (the calls are made on a
closed Client and on objects whose __init__ never ran, so they do nothing); one whose parameters
differ raises the parser's TypeError (an unknown keyword, a missing argument).
"""
import ast
import inspect
import os

import pytest

import tensorshare
from tensorshare import predictor, rl, stream

PKG_DIR = os.path.dirname(tensorshare.__file__)
BOGUS = "_ts_no_such_argument_"


class Anything(str):
    """Passes the argument parsers' conversions: a str ("s"), an int ("i", "L", "K", "n"), a
    float ("d") and a truth value ("p")."""

    def __index__(self):
        return 0

    def __float__(self):
        return 0.0


def stub_classes(module_file):
    """{class name: {member name: ast node}} of a stub file."""
    with open(os.path.join(PKG_DIR, module_file)) as f:
        tree = ast.parse(f.read())
    out = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            members = {}
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AnnAssign)):
                    name = item.name if isinstance(item, ast.FunctionDef) else item.target.id
                    # @overload repeats a name: the last one stands for all.
                    members[name] = item
            out[node.name] = members
    return out


def stub_params(fn):
    """(positional-only names, other positional names, keyword-only names) of a stub, less self."""
    a = fn.args
    posonly = [x.arg for x in a.posonlyargs]
    args = [x.arg for x in a.args]
    if posonly and posonly[0] == "self":
        posonly = posonly[1:]
    elif args and args[0] == "self":
        args = args[1:]
    return posonly, args, [x.arg for x in a.kwonlyargs]


def is_property(node):
    return isinstance(node, ast.AnnAssign) or any(
        isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list)


def public_names(cls):
    return {n for n in dir(cls) if not n.startswith("_") and n not in ("args", "with_traceback")}


# (stub file, class name, the class, documented dunders that must have a stub too)
CLASSES = [
    ("__init__.pyi", "Client", tensorshare.Client, ["__init__", "__enter__", "__exit__"]),
    ("__init__.pyi", "SharedBuffer", tensorshare.SharedBuffer,
     ["__getitem__", "__len__", "__enter__", "__exit__"]),
    ("rl.pyi", "RLTrainer", rl.RLTrainer, ["__init__", "__enter__", "__exit__"]),
    ("rl.pyi", "RLWorker", rl.RLWorker, ["__init__", "__enter__", "__exit__"]),
    ("predictor.pyi", "Predictor", predictor.Predictor, ["__init__", "__enter__", "__exit__"]),
    ("stream.pyi", "StreamProducer", stream.StreamProducer, ["__init__", "__enter__", "__exit__"]),
    ("stream.pyi", "StreamConsumer", stream.StreamConsumer,
     ["__init__", "__enter__", "__exit__", "__iter__", "__next__"]),
]


@pytest.mark.parametrize("stub_file,name,cls,dunders", CLASSES, ids=[c[1] for c in CLASSES])
def test_every_public_member_has_a_stub_and_every_stub_is_real(stub_file, name, cls, dunders):
    stub = stub_classes(stub_file)[name]
    real = public_names(cls)
    assert sorted(real - set(stub)) == [], "members without a stub in " + stub_file
    assert sorted({n for n in stub if not n.startswith("_")} - real) == [], \
        "stubs of members that do not exist"
    for d in dunders:
        assert d in stub and hasattr(cls, d), d


# What argument parsers say when the names or the count of the arguments are wrong.
BINDING_ERRORS = ("keyword argument", "required argument", "missing", "positional argument",
                  "takes at most", "takes no", "takes exactly", "takes two")


def check_by_calling(method, label, posonly, args, kwonly):
    """Call method with the stub's parameters: the call may fail in any way but binding them."""
    try:
        method(*[Anything("x") for _ in posonly], **{n: Anything("x") for n in args + kwonly})
    except TypeError as e:
        assert not any(w in str(e) for w in BINDING_ERRORS), "%s: %s" % (label, e)
    except Exception:  # noqa: BLE001 - closed, not initialised, a value refused: bound fine
        pass
    # And a keyword no method has is refused (the method checks its keywords at all).
    with pytest.raises(TypeError):
        method(*[Anything("x") for _ in posonly], **{n: Anything("x") for n in args + kwonly},
               **{BOGUS: 1})
    if posonly:
        # Positional-only in the stub: the method refuses them by keyword.
        with pytest.raises(TypeError):
            method(**{n: Anything("x") for n in posonly + args})


def uninitialised(cls):
    return cls.__new__(cls)


@pytest.mark.parametrize("stub_file,name,cls,dunders", CLASSES, ids=[c[1] for c in CLASSES])
def test_stub_parameter_names_are_the_real_ones(tensord, stub_file, name, cls, dunders):
    stub = stub_classes(stub_file)[name]
    if cls is tensorshare.Client:
        obj = tensorshare.Client(tensord.address)
        obj.close()
    elif cls is tensorshare.SharedBuffer:
        c = tensorshare.Client(tensord.address)
        obj = c.shared({"x": ("float32", (1,))})
        c.close()
    else:
        obj = uninitialised(cls)
    checked = 0
    for member, node in stub.items():
        if member.startswith("_") or is_property(node):
            continue
        posonly, args, kwonly = stub_params(node)
        method = getattr(obj, member)
        try:
            sig = inspect.signature(method)
        except (TypeError, ValueError):
            sig = None
        if sig is not None and not any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()):
            # A Python method: its signature is there to compare.
            real = [p.name for p in sig.parameters.values()]
            assert real == posonly + args + kwonly, "%s.%s" % (name, member)
            kinds = {p.name: p.kind for p in sig.parameters.values()}
            assert all(kinds[n] == inspect.Parameter.KEYWORD_ONLY for n in kwonly), member
            continue
        check_by_calling(method, "%s.%s" % (name, member), posonly, args, kwonly)
        checked += 1
    if cls is tensorshare.SharedBuffer:
        obj.close()
    assert checked > 0 or cls in (stream.StreamProducer, stream.StreamConsumer)


def test_serve_takes_service_as_documented_and_name_too(tensord):
    c = tensorshare.Client(tensord.address)
    try:
        with c.serve(service="s1", handler=lambda r: r) as svc:
            assert svc.name == "s1"
        with c.serve(name="s2", handler=lambda r: r) as svc:
            assert svc.name == "s2"
        with pytest.raises(TypeError):
            c.serve("s3", lambda r: r, name="s3")
    finally:
        c.close()


def test_keyword_only_parameters_are_refused_by_position(tensord):
    """A stub's keyword-only parameters (after *) are keyword-only in the method too: one more
    positional argument is refused by the parser (Client.call, take and mget took tensor_type
    by position)."""
    c = tensorshare.Client(tensord.address)
    c.close()
    checked = []
    for member, node in stub_classes("__init__.pyi")["Client"].items():
        if member.startswith("_") or is_property(node):
            continue
        posonly, args, kwonly = stub_params(node)
        if not kwonly or node.args.vararg is not None:
            continue
        with pytest.raises(TypeError) as e:
            getattr(c, member)(*[Anything("x") for _ in posonly + args + kwonly[:1]])
        assert any(w in str(e.value) for w in BINDING_ERRORS + ("takes one",)), \
            "%s: %s" % (member, e.value)
        checked.append(member)
    assert {"call", "take", "mget", "get", "peek"} <= set(checked)


def stub_functions(module_file):
    """{name: ast node} of the top-level functions of a stub file."""
    with open(os.path.join(PKG_DIR, module_file)) as f:
        tree = ast.parse(f.read())
    return {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}


@pytest.mark.parametrize("module", ["service", "compat", "ps"])
def test_module_functions_have_the_real_signatures(module):
    import importlib

    mod = importlib.import_module("tensorshare." + module)
    functions = stub_functions(module + ".pyi")
    assert functions
    for name, node in functions.items():
        sig = inspect.signature(getattr(mod, name))
        a = node.args
        stub = [(x.arg, "POSITIONAL_OR_KEYWORD") for x in a.args]
        stub += [(a.vararg.arg, "VAR_POSITIONAL")] if a.vararg else []
        stub += [(x.arg, "KEYWORD_ONLY") for x in a.kwonlyargs]
        stub += [(a.kwarg.arg, "VAR_KEYWORD")] if a.kwarg else []
        real = [(p.name, p.kind.name) for p in sig.parameters.values()]
        assert stub == real, "%s.%s" % (module, name)


@pytest.mark.parametrize("stub_file,name", [("__init__.pyi", "BinInfo"),
                                            ("__init__.pyi", "Notification"),
                                            ("stream.pyi", "StreamEntry")])
def test_struct_sequences_are_stubbed_as_such(stub_file, name):
    """These are struct sequences, not named tuples: the stub must not promise _fields,
    _asdict or _replace, and its fields are the real ones, in order."""
    cls = getattr(tensorshare, name)
    assert not hasattr(cls, "_fields") and not hasattr(cls, "_asdict")
    with open(os.path.join(PKG_DIR, stub_file)) as f:
        node = next(n for n in ast.parse(f.read()).body
                    if isinstance(n, ast.ClassDef) and n.name == name)
    bases = [ast.unparse(b) for b in node.bases]
    assert "NamedTuple" not in bases and bases[0].startswith("structseq["), bases
    fields = [item.name for item in node.body if isinstance(item, ast.FunctionDef)]
    assert tuple(fields) == cls.__match_args__
    assert cls.n_fields == len(fields)


@pytest.mark.parametrize("name", ["VersionMismatchError", "StaleGradientError"])
def test_current_version_exists_on_every_instance(name):
    """The stub declares current_version: an instance the program makes has it too (None)."""
    cls = getattr(tensorshare, name)
    with open(os.path.join(PKG_DIR, "__init__.pyi")) as f:
        node = next(n for n in ast.parse(f.read()).body
                    if isinstance(n, ast.ClassDef) and n.name == name)
    declared = [item.target.id for item in node.body if isinstance(item, ast.AnnAssign)]
    assert declared == ["current_version"]
    assert cls("x").current_version is None
    assert cls().current_version is None
