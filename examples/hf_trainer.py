"""Fine-tune a tiny GPT-2 with `transformers.Trainer`: a config built in the script, token data made here.

Nothing names a device: the Trainer picks it. Under plain `python` that is the CPU; under
`tpu-agent run` it is `tpu`, with no change to the script. Gradient accumulation, an eval loop and
checkpoints every `--save-steps` steps, as a fine-tune script usually has them; `--resume` carries on
from the newest checkpoint in `--output-dir`.

    python examples/hf_trainer.py --steps 8
    tpu-agent run examples/hf_trainer.py -- --steps 8
"""

import argparse

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

VOCAB = 512
SEQ_LEN = 32


class RandomTokens(Dataset):
    """Token sequences with a pattern to learn: each token follows from the one before."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        step = torch.randint(1, 4, (n, 1), generator=g)
        self.ids = (start + step * torch.arange(SEQ_LEN)) % VOCAB

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--output-dir", default="hf_trainer_out")
    parser.add_argument("--save-steps", type=int, default=4)
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    args = parser.parse_args()

    torch.manual_seed(0)
    # Dropout off: the CPU and tpu draw their masks from different random streams, and the two runs'
    # losses are compared.
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ_LEN, n_embd=64, n_layer=2, n_head=4,
                        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=8,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        warmup_steps=2,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=args.save_steps,
        save_steps=args.save_steps,
        report_to="none",
        seed=0,
    )
    trainer = Trainer(model=model, args=training, train_dataset=RandomTokens(64, seed=1),
                      eval_dataset=RandomTokens(16, seed=2))
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    print(f"device={training.device.type}")
    for entry in trainer.state.log_history:
        if "loss" in entry:
            print(f"step={entry['step']} loss={entry['loss']:.6f}")
        if "eval_loss" in entry:
            print(f"step={entry['step']} eval_loss={entry['eval_loss']:.6f}")


if __name__ == "__main__":
    main()
