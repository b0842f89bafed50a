"""The parallel layout of a model on a hardware spec, and what it costs.

One cost model, used by the planner (moeflow/parallel/planner.py: which TP x PP x EP x DP x FSDP
plan) and by the dry run (moeflow/parallel/estimate.py: what every stage of a pipeline costs):

  cost.py          seconds: FLOPs, collectives, a LoRA step, a decode step, a prefill
  footprint.py     bytes a stage's worker holds: one decoder layer, a layer's experts split
                   into groups, the model on one device (memory per device of a plan:
                   moeflow/parallel/memory.py)
  rules.py         which plans can run at all (divisibility, the runtimes' limits)
  remedies.py      what a LoRA plan whose activations do not fit tries: recompute, then CP
  candidates.py    a checked plan and a search's outcome
  messages.py      what the planner says: infeasibility, the smallest hardware, rows
  translate.py     a plan as transformers' DistributedConfig and as the plan.json record
  workload.py      the planner's workload and the serving backend from a pipeline config
  pricing.py       the dry run's terms, stage estimates, rates and host probe
  stage_prices.py  convert, plan, operators, finetune, calibrate, regress priced
  serving_prices.py  the serving search and deploy priced, on the backend that serves
  checks.py        what a real run would find late: space, memory per device, SLOs, data

    python -c "from moeflow.parallel.cost import lora_cost"   # library
"""
