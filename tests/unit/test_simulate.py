

def test_phase_breakdown_adds_up_to_the_step_and_names_the_wait() -> None:
    """Two ranks in a step: the busiest rank's phases over the steady window, plus the rest as `wait`."""
    from graphrl.compiler.simulate import SimResult, Span, phase_breakdown

    # Steps end at 1, 2, 3, 4 s; the window is [3, 4] (from the middle step's end to the last), one step.
    spans = [Span(0, "g", "Generate", 3.0, 3.25), Span(0, "t", "TrainStep", 3.25, 3.75),
             Span(1, "g", "Generate", 3.0, 3.25), Span(0, "t", "TrainStep", 2.0, 3.0)]
    result = SimResult(makespan_s=4.0, step_time_s=1.0, step_done_s=[1.0, 2.0, 3.0, 4.0], busy_fraction=[0.0, 0.0],
                       spans=spans)
    assert phase_breakdown(result) == {"generate": 0.25, "train": 0.5, "wait": 0.25}
