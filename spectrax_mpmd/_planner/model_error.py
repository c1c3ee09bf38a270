"""How far the timing tests let a prediction miss a step it never ran: the predicted ratio of two
steps their measured ratio (`tests/mpmd/test_mpmd_planner_costs.py`,
`tests/mpmd/test_mpmd_planner_calibrated.py`), and a calibrated step time the measured one
(`tests/mpmd/test_mpmd_planner_calibrated.py`), each by at most this share of the measured value."""

MODEL_ERROR = 0.25
