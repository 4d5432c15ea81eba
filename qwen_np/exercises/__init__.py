"""Graded exercises (`python -m qwen_np exercises`): the walkthrough's questions as files a learner fills
in and a check that can fail. `catalog` (every exercise: its number, section, one line, its stub made from
its solution), `grading` (a learner's file loaded and its answers compared, input by input), `checks` (each
exercise's check: the learner's functions against qwen_np's own on random inputs, awkward shapes included),
`solutions/` (the reference answers, one module per exercise; `exercises check N --solution` grades them).

May import: training/, inspection/, generation/, engine/, files/, core/, numbers/, qwen_np.errors.
"""
