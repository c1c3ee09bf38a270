"""spx.inspect: tabulate (definition order, shapes, counts), display, hlo_cost."""

import jax
import jax.numpy as jnp
import pytest

import spectrax_eager as spx


class Lin(spx.Module):
    def __init__(self, d_in, d_out):
        self.weight = spx.Parameter(jnp.ones((d_in, d_out)))

    def forward(self, x):
        return x @ self.weight.value


class Net(spx.Module):
    def __init__(self):
        self.zeta = Lin(4, 8)  # defined first, named to sort last
        self.alpha = Lin(8, 2)
        self.unused = Lin(2, 2)
        self.stat = spx.Buffer(jnp.zeros(5))

    def forward(self, x):
        return self.alpha(jax.nn.relu(self.zeta(x)))


def test_tabulate_rows_in_definition_order():
    table = spx.inspect.tabulate(Net(), jnp.ones((3, 4)))
    lines = table.splitlines()
    rows = [[c.strip() for c in l.split("|")] for l in lines[2:6]]
    assert [r[0] for r in rows] == ["(root)", "zeta", "alpha", "unused"]
    assert rows[0][1:] == ["Net", "float32[3,2]", "52", "228"]
    assert rows[1][1:] == ["Lin", "float32[3,8]", "32", "128"]
    assert rows[2][1:] == ["Lin", "float32[3,2]", "16", "64"]
    assert rows[3][1:] == ["Lin", "-", "4", "16"]
    assert lines[-1] == "total: 52 parameters, 228 bytes"
    assert spx.inspect.count_parameters is spx.count_parameters and spx.inspect.summary is spx.summary


def test_display_prints_the_tree(capsys):
    spx.inspect.display(Net())
    out = capsys.readouterr().out
    assert out.index("zeta=") < out.index("alpha=") and "float32[4,8]" in out
    assert out.strip().endswith("total: 52 parameters, 228 bytes")
    with pytest.raises(TypeError, match="spx.Module"):
        spx.inspect.display(3)


def test_hlo_cost_counts_matmul_flops():
    m, k, n = 16, 32, 8
    lin = Lin(k, n)
    cost = spx.inspect.hlo_cost(lambda mod, x: mod(x), lin, jnp.ones((m, k)))
    assert cost["flops"] == 2 * m * k * n  # one multiply and one add per term
    assert cost["bytes_accessed"] >= 4 * (m * k + k * n + m * n)
    assert set(cost) >= {"flops", "bytes_accessed", "transcendentals"}
