"""A short PPO loop whose collector workers get their weights through zmqsync.

    python tools/torchrl_ppo_example.py                   # ZmqWeightSyncScheme
    python tools/torchrl_ppo_example.py --scheme shared   # torchrl's SharedMemWeightSyncScheme
    python tools/torchrl_ppo_example.py --sync 1          # bounded staleness (zmq only)

Only the scheme given to the collector differs between the two. Two
worker processes collect from a tiny env (move a point on a line to a target); the
trainer runs PPO on each batch and publishes the new policy with
``collector.update_policy_weights_()``. Each row shows which policy versions produced the
batch (``("next", "policy_version")``, written by the workers), the mean reward, and how
long the weight update took. ``--sync`` is the schemes' ``sync=``: ``true`` (the default)
waits until both workers applied the version, ``false`` does not wait, and an int k
(ZmqWeightSyncScheme only) waits until neither is more than k versions behind. Needs
torchrl: ``pip install 'torchrl>=0.14'`` (or the extra by path, ``pip install '.[torchrl]'``
in a checkout).
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import NormalParamExtractor, TensorDictModule
from torch import nn

with warnings.catch_warnings():  # torchrl's legacy weight updaters warn on import
    warnings.simplefilter("ignore", DeprecationWarning)
    from torchrl.collectors import MultiSyncCollector
    from torchrl.data import Bounded, Composite, Unbounded
    from torchrl.envs import EnvBase, StepCounter, TransformedEnv
    from torchrl.modules import MLP, ProbabilisticActor, TanhNormal, ValueOperator
    from torchrl.objectives import ClipPPOLoss
    from torchrl.objectives.value import GAE
    from torchrl.weight_update import SharedMemWeightSyncScheme

from zmqsync.integrations.torchrl import ZmqWeightSyncScheme


class ReachEnv(EnvBase):
    """Observation (position, target) on a line; the action moves the point by up to 0.25;
    the reward is minus the distance to the target."""

    def __init__(self) -> None:
        super().__init__(batch_size=torch.Size([]))
        self.observation_spec = Composite(observation=Unbounded(shape=(2,)))
        self.action_spec = Bounded(-1.0, 1.0, shape=(1,))
        self.reward_spec = Unbounded(shape=(1,))
        self._state = torch.zeros(2)

    def _reset(self, tensordict: TensorDictBase | None) -> TensorDictBase:
        self._state = torch.rand(2) * 4 - 2
        return TensorDict(observation=self._state.clone(), done=torch.zeros(1, dtype=torch.bool))

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        move = tensordict["action"].clamp(-1, 1) * 0.25
        self._state = torch.cat([self._state[:1] + move, self._state[1:]])
        reward = -(self._state[:1] - self._state[1:]).abs()
        done = torch.zeros(1, dtype=torch.bool)
        return TensorDict(observation=self._state.clone(), reward=reward, done=done)

    def _set_seed(self, seed: int | None) -> None:
        torch.manual_seed(0 if seed is None else seed)


def make_env() -> TransformedEnv:
    return TransformedEnv(ReachEnv(), StepCounter(max_steps=20))


def make_actor_critic() -> tuple[ProbabilisticActor, ValueOperator]:
    body = nn.Sequential(MLP(in_features=2, out_features=2, num_cells=[64]), NormalParamExtractor())
    actor = ProbabilisticActor(
        TensorDictModule(body, in_keys=["observation"], out_keys=["loc", "scale"]),
        in_keys=["loc", "scale"],
        distribution_class=TanhNormal,
        distribution_kwargs={"low": -1.0, "high": 1.0},
        return_log_prob=True,
    )
    critic = ValueOperator(MLP(in_features=2, out_features=1, num_cells=[64]), ["observation"])
    return actor, critic


def sync_option(text: str) -> bool | int:
    """``--sync``: "true", "false", or an int k (the most versions a worker may lag)."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"true, false or an int, not {text!r}") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheme", choices=["zmq", "shared"], default="zmq")
    parser.add_argument(
        "--sync",
        type=sync_option,
        default=True,
        help="how long an update waits: true, false, or k (zmq: no worker k versions behind)",
    )
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--frames", type=int, default=800, help="frames per batch")
    args = parser.parse_args()
    if args.scheme == "shared" and not isinstance(args.sync, bool):
        parser.error("torchrl's SharedMemWeightSyncScheme takes --sync true or false")
    torch.manual_seed(0)
    actor, critic = make_actor_critic()
    if args.scheme == "zmq":
        scheme = ZmqWeightSyncScheme(sync=args.sync)
    else:
        scheme = SharedMemWeightSyncScheme(sync=args.sync)
    start = time.perf_counter()
    collector = MultiSyncCollector(
        [make_env, make_env],
        actor,
        frames_per_batch=args.frames,
        total_frames=args.frames * args.iterations,
        weight_sync_schemes={"policy": scheme},
        track_policy_version=True,
    )
    print(f"{type(scheme).__name__}: 2 workers ready in {time.perf_counter() - start:.1f} s")
    loss = ClipPPOLoss(actor, critic, entropy_coeff=1e-3, normalize_advantage=True)
    advantage = GAE(gamma=0.9, lmbda=0.95, value_network=critic)
    optim = torch.optim.Adam(loss.parameters(), lr=3e-3)
    print("iter  batch versions  mean reward  update ms")
    try:
        for i, batch in enumerate(collector):
            batch_versions = batch["next", "policy_version"].unique().tolist()
            reward = batch["next", "reward"].mean().item()
            with torch.no_grad():
                advantage(batch)
            frames = batch.reshape(-1)
            for _ in range(4):  # epochs
                for idx in torch.randperm(frames.numel()).split(200):
                    losses = loss(frames[idx])
                    total = losses["loss_objective"] + losses["loss_critic"]
                    optim.zero_grad()
                    (total + losses["loss_entropy"]).backward()
                    optim.step()
            tick = time.perf_counter()
            collector.update_policy_weights_()  # publish; wait as --sync says
            update_ms = (time.perf_counter() - tick) * 1e3
            print(f"{i:4d}  {str(batch_versions):>14}  {reward:11.3f}  {update_ms:9.2f}")
    finally:
        if isinstance(scheme, ZmqWeightSyncScheme) and scheme.publisher is not None:
            workers = sorted(scheme.publisher.workers)
            print(f"bus {scheme.name!r} at version {scheme.version}, workers {workers}")
        collector.shutdown()
        if isinstance(scheme, ZmqWeightSyncScheme):
            scheme.shutdown()  # torchrl's collectors do not shut their schemes down
    print(f"done in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
