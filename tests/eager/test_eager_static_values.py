"""A module's static lists, dicts and sets (nested too) are immutable: an in-place edit raises
`StaticEditError` naming the attribute, a new value retraces, and neither `spx.jit` nor `jax.jit`
over the module ever runs a program traced with old content."""

import copy
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spectrax_eager as spx


def total(static):
    """The sum of every number in a nested list/dict/set/tuple (how the model reads its static)."""
    if isinstance(static, dict):
        return sum(total(v) for v in static.values())
    if isinstance(static, list | tuple | set):
        return sum(total(v) for v in static)
    return static


class Net(spx.Module):
    def __init__(self, static):
        self.weight = spx.Parameter(jnp.arange(1.0, 5.0))
        self.static = static

    def forward(self, x):
        return x * self.weight.value * total(self.static)


def reference(static, x):
    return np.asarray(x) * np.arange(1.0, 5.0) * total(static)


X = jnp.full((4,), 0.5)

# (initial static value, an in-place edit of it, the path the error names)
EDITS = {
    "list setitem": ([1.0, 2.0], lambda s: s.__setitem__(0, 3.0), r"Net\.static:"),
    "list append": ([1.0, 2.0], lambda s: s.append(3.0), r"Net\.static:"),
    "list extend": ([1.0, 2.0], lambda s: s.extend([3.0]), r"Net\.static:"),
    "list del": ([1.0, 2.0], lambda s: s.__delitem__(0), r"Net\.static:"),
    "list sort": ([2.0, 1.0], lambda s: s.sort(), r"Net\.static:"),
    "dict setitem": ({"a": 1.0}, lambda s: s.__setitem__("a", 5.0), r"Net\.static:"),
    "dict update": ({"a": 1.0}, lambda s: s.update(b=2.0), r"Net\.static:"),
    "dict pop": ({"a": 1.0, "b": 2.0}, lambda s: s.pop("a"), r"Net\.static:"),
    "dict setdefault": ({"a": 1.0}, lambda s: s.setdefault("b", 2.0), r"Net\.static:"),
    "set add": ({1.0, 2.0}, lambda s: s.add(3.0), r"Net\.static:"),
    "set discard": ({1.0, 2.0}, lambda s: s.discard(1.0), r"Net\.static:"),
    "list of dicts": ([{"a": 1.0}, {"b": 2.0}], lambda s: s[1].__setitem__("b", 7.0), r"Net\.static\[1\]:"),
    "dict of lists": ({"a": [1.0], "b": [2.0]}, lambda s: s["b"].append(3.0), r"Net\.static\['b'\]:"),
    "dict of sets": ({"a": {1.0}}, lambda s: s["a"].add(4.0), r"Net\.static\['a'\]:"),
    "list of lists": ([[1.0], [2.0, 3.0]], lambda s: s[1].reverse(), r"Net\.static\[1\]:"),
    "tuple holding a list": ((1.0, [2.0]), lambda s: s[1].insert(0, 6.0), r"Net\.static\[1\]:"),
}


def compiled():
    return spx.jit(lambda m, x: m(x)), jax.jit(lambda m, x: m(x))


@pytest.mark.parametrize("name", list(EDITS))
def test_in_place_edit_raises_and_no_program_goes_stale(name):
    initial, edit, path = EDITS[name]
    m = Net(copy.deepcopy(initial))
    f, g = compiled()
    f(m, X), g(m, X)
    with pytest.raises(spx.StaticEditError, match=path + r".*`module\.static = new`"):
        edit(m.static)
    assert m.static == initial  # nothing changed
    want = reference(initial, X)
    for out in (m(X), f(m, X), g(m, X), f(m, x=X)):
        np.testing.assert_allclose(out, want, rtol=1e-6)


def test_augmented_assignment_on_the_attribute_raises():
    m = Net([1.0])
    with pytest.raises(spx.StaticEditError, match=r"Net\.static: `x \+= y`"):
        m.static += [2.0]
    m2 = Net({"a": 1.0})
    with pytest.raises(spx.StaticEditError, match=r"Net\.static: `x \|= y`"):
        m2.static |= {"b": 2.0}
    assert m.static == [1.0] and m2.static == {"a": 1.0}


# (initial, new value) pairs of every kind and nesting: assigning retraces, never stale
REASSIGN = {
    "list": ([1.0, 2.0], [3.0, 2.0]),
    "dict": ({"a": 1.0}, {"a": 1.0, "b": 4.0}),
    "set": ({1.0}, {1.0, 5.0}),
    "list of dicts": ([{"a": 1.0}], [{"a": 1.0}, {"b": 3.0}]),
    "dict of lists": ({"a": [1.0]}, {"a": [1.0, 2.5]}),
    "tuple holding a dict": ((1.0, {"a": 2.0}), (1.0, {"a": 9.0})),
}


@pytest.mark.parametrize("name", list(REASSIGN))
def test_reassigned_static_is_seen_by_spx_jit_and_jax_jit(name):
    old, new = REASSIGN[name]
    m = Net(copy.deepcopy(old))
    f, g = compiled()
    np.testing.assert_allclose(f(m, X), reference(old, X), rtol=1e-6)
    np.testing.assert_allclose(g(m, X), reference(old, X), rtol=1e-6)
    m.static = copy.deepcopy(new)
    want = reference(new, X)
    assert not np.allclose(want, reference(old, X))  # a stale program would fail below
    for out in (m(X), f(m, X), g(m, X), f(m, x=X)):
        np.testing.assert_allclose(out, want, rtol=1e-6)


def test_edit_a_copy_and_assign_it_back():
    m = Net({"sizes": [1.0, 2.0], "shift": 0.5})
    f = spx.jit(lambda m, x: m(x))
    f(m, X)
    edited = dict(m.static)
    edited["sizes"] = [*m.static["sizes"], 4.0]
    m.static = edited
    np.testing.assert_allclose(f(m, X), reference({"sizes": [1.0, 2.0, 4.0], "shift": 0.5}, X), rtol=1e-6)


def test_the_module_keeps_a_copy_of_the_assigned_container():
    scales = [1.0, 2.0]
    m = Net(scales)
    f, g = compiled()
    f(m, X), g(m, X)
    scales[0] = 10.0  # the caller's list stays theirs; the module's copy is unchanged
    assert scales == [10.0, 2.0] and m.static == [1.0, 2.0]
    for out in (m(X), f(m, X), g(m, X)):
        np.testing.assert_allclose(out, reference([1.0, 2.0], X), rtol=1e-6)


def test_static_containers_read_like_plain_ones():
    m = Net({"a": [1, 2], "b": {3}})
    assert m.static == {"a": [1, 2], "b": {3}} and isinstance(m.static, dict)
    assert isinstance(m.static["a"], list) and isinstance(m.static["b"], set)
    assert m.static["a"] + [3] == [1, 2, 3] and type(list(m.static["a"])) is list
    assert repr(m.static) == "{'a': [1, 2], 'b': {3}}"


@pytest.mark.parametrize(
    "duplicate",
    [copy.copy, copy.deepcopy, lambda v: pickle.loads(pickle.dumps(v))],
    ids=["copy", "deepcopy", "pickle"],
)
def test_copies_stay_immutable(duplicate):
    m = Net({"a": [1.0]})
    dup = duplicate(m.static)
    assert dup == m.static
    with pytest.raises(spx.StaticEditError, match=r"Net\.static\['a'\]"):
        dup["a"].append(2.0)


def test_clones_stay_immutable():
    m = Net([1.0, {"a": 2.0}])
    other = spx.clone(m)
    assert other.static == m.static
    with pytest.raises(spx.StaticEditError, match=r"Net\.static\[1\]"):
        other.static[1]["a"] = 3.0


def test_variable_metadata_containers_are_immutable():
    class Tagged(spx.Module):
        def __init__(self):
            self.w = spx.Parameter(jnp.ones(2), tags=["a"])

        def forward(self, x):
            return x * self.w.value * len(self.w.tags)

    m = Tagged()
    f = spx.jit(lambda m, x: m(x))
    np.testing.assert_allclose(f(m, jnp.ones(2)), [1.0, 1.0])
    with pytest.raises(spx.StaticEditError, match=r"Parameter metadata 'tags'.*set_metadata\(tags=new\)"):
        m.w.tags.append("b")
    m.w.set_metadata(tags=["a", "b"])
    np.testing.assert_allclose(f(m, jnp.ones(2)), [2.0, 2.0])
    with pytest.raises(spx.StaticEditError):
        m.w.tags.append("c")
