"""Publishing: stage a checkpoint, run or adapter with its model card, and upload it to the Hub.

    from retrofit.hub import push
    push("runs/llama-avnorm", "me/smollm2-avnorm", dry_run="staged/")   # write what would go up

Modules: model_card (README.md from what was staged), public (names not local paths; no symbolic links)
<- publish (stage, push, upload). The CLI is commands/push.py.
"""

from .model_card import GUARD, model_card
from .publish import check_repo, find_token, push, stage, upload_folder

__all__ = ["GUARD", "check_repo", "find_token", "model_card", "push", "stage", "upload_folder"]
