"""The GRPO job of `grpo_tiny.yaml`, written with the Python API. `build_job()` returns an equal JobSpec.

Run it with `graphrl validate examples/grpo_tiny.py` or import `build_job` from your own script.
"""

from graphrl.builder import Job
from graphrl.schemas import JobSpec


def build_job() -> JobSpec:
    job = Job("grpo_tiny", description="GRPO, tiny policy, digit-copy task, two CPU ranks", cluster="local-cpu-2")
    policy = job.model("policy", preset="tiny-digits-tied", dtype="float32")
    prompts = job.dataset("prompts", task="digits-copy", batch_size=16, prompt_len=6, options={"num_digits": 4})
    rollout = job.generate("rollout", policy, prompts=prompts.out("prompts"),
                           samples_per_prompt=16, max_new_tokens=5, temperature=1.0)
    score = job.reward("score", fn="digits_copy", rollouts=rollout.out("rollouts"))
    adv = job.advantage("adv", "grpo", rewards=score.out("rewards"), rollouts=rollout.out("rollouts"))
    job.train("update", policy, loss="grpo", rollouts=rollout.out("rollouts"), advantages=adv.out("advantages"))
    job.algorithm(lr=1.0e-3, clip_eps=0.2)
    job.schedule(mode="sync", steps=400)
    job.run(seed=0)
    return job.build()


if __name__ == "__main__":
    print(build_job().model_dump_json(indent=2))
