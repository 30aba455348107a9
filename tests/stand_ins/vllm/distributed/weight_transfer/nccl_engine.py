"""Server mode's NCCL weight transfer: imported by TRL, not stood in (colocate needs none)."""


class NCCLTrainerSendWeightsArgs:
    def __init__(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError("the vLLM stand-in runs colocate mode only")


NCCLWeightTransferEngine = NCCLTrainerSendWeightsArgs
