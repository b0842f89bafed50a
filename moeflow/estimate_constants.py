"""The dry run's host-measured constants (moeflow/estimate.py), each with its provenance.

Seconds on the anchor host (cpu-local) at its probe time ANCHOR_PROBE_S; a dry run on a host of
that kind scales them by its own probe. Written by benchmarks/fit_dryrun.py --write from the
pipeline runs in benchmarks/data/dryrun_runs.json (each run's estimate.json beside its measured
<stage>.seconds): basis "fitted" names the stage whose residual fits it and the runs; "assumed"
is a figure no recorded run measures on its own. Not edited by hand: tests/test_fit_dryrun.py
refits the committed runs and fails when a fitted value differs.
"""

from typing import Any

ANCHOR_PROBE_S = 0.102

CONSTANTS: dict[str, dict[str, Any]]
CONSTANTS = {'PROCESS_START_S': {'value': 8.0,
                     'basis': 'assumed',
                     'how': 'a fresh Ray worker importing torch, transformers, PEFT and MLflow; fitted on '
                            'convert (2 starts) once runs are recorded'},
 'STAGE_OVERHEAD_S': {'value': 0.6,
                      'basis': 'assumed',
                      'how': "a stage's MLflow child run: in every stage beside that stage's own fitted "
                             'term, so no stage measures it alone'},
 'TRAIN_SETUP_S': {'value': 14.0,
                   'basis': 'assumed',
                   'how': 'Ray Train controller, a 2-worker group, gloo and teardown; fitted on finetune '
                          'once runs are recorded'},
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
 'EVAL_MODEL_S': {'value': 1.0,
                  'basis': 'assumed',
                  'how': 'regress: per model evaluated beyond its FLOPs (load, scoring, tables); fitted on '
                         'regress once runs are recorded'},
 'SPAWN_START_S': {'value': 3.0,
                   'basis': 'assumed',
                   'how': "a process spawned by torch.multiprocessing (operators' dispatch timing, imports "
                          'torch only)'},
 'CORE_START_S': {'value': 5.0,
                  'basis': 'assumed',
                  'how': "deploy.engine_process: a replica's engine core, a fresh interpreter importing "
                         'torch and transformers'},
 'COMPILE_WARMUP_S': {'value': 80.0,
                      'basis': 'assumed',
                      'how': 'deploy.compile: a replica compiles its forwards before serving, priced with an '
                             'empty Inductor cache (the demo model: 76-80 s cold, 19-21 s warm, by hand; the '
                             'demo does not compile)'},
 'CALIBRATE_S': {'value': 1.3,
                 'basis': 'assumed',
                 'how': "calibrate: the precision plan's compare passes, report and plots; fitted on "
                        'calibrate once runs are recorded'},
 'CHART_S': {'value': 0.3,
             'basis': 'assumed',
             'how': "plan: the memory chart beside the planner's searches; fitted on plan once runs are "
                    'recorded'},
 'EPLB_S': {'value': 1.0,
            'basis': 'assumed',
            'how': 'operators: EPLB, the heatmap and their MLflow artifacts; fitted on operators once runs '
                   'are recorded'},
 'SERVING_TAIL_S': {'value': 12.0,
                    'basis': 'assumed',
                    'how': 'serving: teardown and reports after its search; fitted on serving once runs are '
                           'recorded'},
 'SMOKE_S': {'value': 2.0,
             'basis': 'assumed',
             'how': "deploy: per model, the smoke request and the endpoint's readiness; fitted on deploy "
                    'once runs are recorded'},
 'PIPELINE_START_S': {'value': 2.0,
                      'basis': 'assumed',
                      'how': 'the parent run beyond its stages (cache lookups, hand-offs, publishing); '
                             'fitted on the pipeline once runs are recorded'}}
