"""A table written by hand in PyTorch's schedule CSV runs through the MPMD runtime exactly.

Two ranks hold four stages in a V (rank 0 stages 0 and 3, rank 1 stages 1 and 2), as PyTorch
numbers a V schedule's stages; the rows carry PyTorch's send and receive actions, an FSDP
`UNSHARD`, idle fields, a gradient reduction and an overlapped forward and backward. Loss and
gradients equal `jax.value_and_grad` of the unsplit function on one device (rtol 1e-5), and
each rank issues exactly the row's compute cells, in order.
"""

import io

import jax
from mpmd_cases import assert_close, hetero_batch, hetero_loss, hetero_params, pipeline_mesh

import spectrax_mpmd as mp
from spectrax_core import schedules as S

TORCH_CSV = (  # one CSV row per rank (rank 0's row is split over two lines here)
    "0UNSHARD,0F0,0SEND_F0,0F1,0SEND_F1,3UNSHARD,3RECV_F0,3F0,3I0,3SEND_B0,3RECV_F1,0RECV_B0,"
    "(3F1;0B0)OVERLAP_F_B,3I1,3SEND_B1,0RECV_B1,0B1,3W0,3W1,0REDUCE_GRAD,3REDUCE_GRAD\n"
    ",1RECV_F0,1F0,2F0,2SEND_F0,1RECV_F1,1F1,2F1,2SEND_F1,,,2RECV_B0,2B0,1B0,1SEND_B0,2RECV_B1,2B1,1B1,1SEND_B1\n"
)


def test_a_hand_written_torch_csv_table_runs_exactly():
    schedule = S.read_torch_csv(io.StringIO(TORCH_CSV))
    n, m = 2, 2
    assert schedule.microbatches == m and schedule.num_stages(n) == 4
    assert [schedule.stages_of(r, n) for r in range(n)] == [(0, 3), (1, 2)]
    params, batch = hetero_params(jax.random.key(0), 4), hetero_batch(batch=2 * m)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(hetero_loss))(params, batch)
    step = mp.sxvalue_and_grad(hetero_loss, mesh=pipeline_mesh(n), schedule=schedule)
    loss, grads = step(params, batch)
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)
    per_rank = [tuple(a for r, a, _ in step.dispatch_log if r == rank) for rank in range(n)]
    assert per_rank == [tuple(row) for row in schedule.actions(n)]
    assert S.FusedAction.parse("3F1&0B0") in per_rank[0]
