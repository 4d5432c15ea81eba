"""Exercise 18 (section 11): the learning rate at which training diverges.

Train the `tiny` preset's model (qwen_np.training.settings.PRESET_CONFIGS["tiny"], fresh weights:
qwen_np.training.parameters.init_parameters(config, seed=0)) for 12 steps on one fixed batch of 4 x 17
token ids drawn over the whole vocabulary (np.random.default_rng(0).integers(0, config.vocab_size, (4, 17))),
gradients clipped to norm 1, with AdamW (qwen_np.training.step: loss_and_gradients, clip_gradients,
adamw_for) at the constant learning rates 0.01, 0.03, 0.1, 0.3, 1 and 3. From which rate does the loss blow
up, rising more than 5 nats above its first value? Set ANSWER to that rate. The check trains them again.
"""

ANSWER = 1.0
