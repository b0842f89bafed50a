"""The dry run's host-measured constants (moeflow/parallel/estimate.py), each with its provenance.

Seconds on the anchor host (cpu-local) at its probe time ANCHOR_PROBE_S; a dry run on a host of
that kind scales them by its own probe. Written by benchmarks/fit_dryrun.py --write from the
pipeline runs in benchmarks/data/dryrun_runs.json (each run's estimate.json beside its measured
<stage>.seconds): basis "fitted" names the stage whose residual fits it and the runs; "assumed"
is a figure no recorded run measures on its own. ANCHOR_PROBE_HOW says where ANCHOR_PROBE_S
came from. Not edited by hand: tests/test_fit_dryrun.py refits the committed runs and fails
when a fitted value differs.
"""

from typing import Any

ANCHOR_PROBE_S = 0.1401
ANCHOR_PROBE_HOW = ('probe_host() read 0.1401 s (median of 5, 0.1397-0.1412) on 2026-12-06 on the host of the data '
 "set's runs priced at host x1: 0.1401 / 1 (benchmarks/fit_dryrun.py --anchor 1)")

CONSTANTS: dict[str, dict[str, Any]]
CONSTANTS = {'PROCESS_START_S': {'value': 5.341,
                     'basis': 'fitted',
                     'what': 'a fresh Ray worker importing torch, transformers, PEFT and MLflow',
                     'how': 'convert: measured minus its other terms, per run / coefficient; the median of 4 '
                            'run(s), 4.92 to 5.6',
                     'runs': ['a0fa1af9b14b4f789f189f7232fd1ff6',
                              'e4c4d2609d394ffdb3bcae13aa53a800',
                              'e83fae5c5af6467593d19b1caaf17109',
                              '307bd6e88fa744ccb6a4f9e54a1d284c']},
 'STAGE_OVERHEAD_S': {'value': 0.6,
                      'basis': 'assumed',
                      'how': "a stage's MLflow child run: in every stage beside that stage's own fitted "
                             'term, so no stage measures it alone'},
 'TRAIN_SETUP_S': {'value': 2.033,
                   'basis': 'fitted',
                   'what': 'Ray Train controller, a 2-worker group, gloo and teardown',
                   'how': 'finetune: measured minus its other terms, per run / coefficient; the median of 4 '
                          'run(s), 1.12 to 2.19',
                   'runs': ['a0fa1af9b14b4f789f189f7232fd1ff6',
                            'e4c4d2609d394ffdb3bcae13aa53a800',
                            'e83fae5c5af6467593d19b1caaf17109',
                            '307bd6e88fa744ccb6a4f9e54a1d284c']},
 'TRAIN_SETUP_PER_DOUBLING_S': {'value': 2.0,
                                'basis': 'assumed',
                                'how': 'Ray Train set-up beyond 2 workers, per doubling of the worker count '
                                       '(workers start in parallel; the rendezvous grows with log2 of them): '
                                       'no recorded run has more than 2 workers'},
 'STEP_OVERHEAD_S': {'value': 0.025,
                     'basis': 'assumed',
                     'how': "per optimizer step beyond its FLOPs (Python, optimizer, logging): finetune's "
                            'runs fit TRAIN_SETUP_S, which absorbs it at one max_steps'},
 'EVAL_STEP_S': {'value': 0.0533,
                 'basis': 'assumed',
                 'how': "host time per decode step of finetune's exact-match eval (one batch of "
                        "eval_batch_size), beyond the planner's FLOPs and HBM terms"},
 'EVAL_MODEL_S': {'value': 0.778,
                  'basis': 'fitted',
                  'what': 'regress: per model evaluated beyond its FLOPs (load, scoring, tables)',
                  'how': 'regress: measured minus its other terms, per run / coefficient; the median of 4 '
                         'run(s), 0.546 to 0.867',
                  'runs': ['a0fa1af9b14b4f789f189f7232fd1ff6',
                           'e4c4d2609d394ffdb3bcae13aa53a800',
                           'e83fae5c5af6467593d19b1caaf17109',
                           '307bd6e88fa744ccb6a4f9e54a1d284c']},
 'SPAWN_START_S': {'value': 3.0,
                   'basis': 'assumed',
                   'how': "a process spawned by torch.multiprocessing (operators' dispatch timing, imports "
                          'torch only)'},
 'CORE_START_S': {'value': 5.0,
                  'basis': 'assumed',
                  'how': "deploy.engine_process: a replica's engine core, a fresh interpreter importing "
                         'torch and transformers'},
 'COMPILE_WARMUP_S': {'value': 110.0,
                      'basis': 'assumed',
                      'how': 'deploy.compile: a replica compiles its forwards before serving, priced with an '
                             'empty Inductor cache: benchmarks/bench_compile_warmup.py on the demo model (7 '
                             "graphs), CPU seconds over the probe's factor, cold 104.5 and 115.3 s in two "
                             'runs at load 4-27 (a warm cache: 25.0 and 24.4 s); the demo does not compile'},
 'CALIBRATE_S': {'value': 1.216,
                 'basis': 'fitted',
                 'what': "calibrate: the precision plan's compare passes, report and plots",
                 'how': 'calibrate: measured minus its other terms, per run / coefficient; the median of 4 '
                        'run(s), 0.686 to 1.84',
                 'runs': ['a0fa1af9b14b4f789f189f7232fd1ff6',
                          'e4c4d2609d394ffdb3bcae13aa53a800',
                          'e83fae5c5af6467593d19b1caaf17109',
                          '307bd6e88fa744ccb6a4f9e54a1d284c']},
 'CHART_S': {'value': 0.043,
             'basis': 'fitted',
             'what': "plan: the memory chart beside the planner's searches",
             'how': 'plan: measured minus its other terms, per run / coefficient; the median of 4 run(s), '
                    '0.0156 to 0.268',
             'runs': ['a0fa1af9b14b4f789f189f7232fd1ff6',
                      'e4c4d2609d394ffdb3bcae13aa53a800',
                      'e83fae5c5af6467593d19b1caaf17109',
                      '307bd6e88fa744ccb6a4f9e54a1d284c']},
 'EPLB_S': {'value': 0.023,
            'basis': 'fitted',
            'what': 'operators: EPLB, the heatmap and their MLflow artifacts',
            'how': 'operators: measured minus its other terms, per run / coefficient; the median of 4 '
                   'run(s), -0.477 to 0.417',
            'runs': ['a0fa1af9b14b4f789f189f7232fd1ff6',
                     'e4c4d2609d394ffdb3bcae13aa53a800',
                     'e83fae5c5af6467593d19b1caaf17109',
                     '307bd6e88fa744ccb6a4f9e54a1d284c']},
 'SERVING_TAIL_S': {'value': 0.0,
                    'basis': 'fitted',
                    'what': 'serving: teardown and reports after its search',
                    'how': 'serving: measured minus its other terms, per run / coefficient; the median of 4 '
                           'run(s), -13.6 to -9.67 (negative: the other terms over-price it; held at 0)',
                    'runs': ['a0fa1af9b14b4f789f189f7232fd1ff6',
                             'e4c4d2609d394ffdb3bcae13aa53a800',
                             'e83fae5c5af6467593d19b1caaf17109',
                             '307bd6e88fa744ccb6a4f9e54a1d284c']},
 'SMOKE_S': {'value': 0.613,
             'basis': 'fitted',
             'what': "deploy: per model, the smoke request and the endpoint's readiness",
             'how': 'deploy: measured minus its other terms, per run / coefficient; the median of 4 run(s), '
                    '0.192 to 1.51',
             'runs': ['a0fa1af9b14b4f789f189f7232fd1ff6',
                      'e4c4d2609d394ffdb3bcae13aa53a800',
                      'e83fae5c5af6467593d19b1caaf17109',
                      '307bd6e88fa744ccb6a4f9e54a1d284c']},
 'PIPELINE_START_S': {'value': 5.455,
                      'basis': 'fitted',
                      'what': 'the parent run beyond its stages (cache lookups, hand-offs, publishing)',
                      'how': 'pipeline: measured minus its other terms, per run / coefficient; the median of '
                             '4 run(s), 5.2 to 5.8',
                      'runs': ['a0fa1af9b14b4f789f189f7232fd1ff6',
                               'e4c4d2609d394ffdb3bcae13aa53a800',
                               'e83fae5c5af6467593d19b1caaf17109',
                               '307bd6e88fa744ccb6a4f9e54a1d284c']}}
