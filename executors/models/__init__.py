"""Native PyTorch model architectures the executors train and sample from (Llama today).

They live here, not behind Hugging Face `transformers`, so that generation, teacher-forced log-probs
and weight sync share one small, readable implementation whose parameter names still match Hugging
Face checkpoints.
"""
