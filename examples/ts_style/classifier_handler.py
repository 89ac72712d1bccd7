"""An unmodified TorchServe-style handler: it only imports from ``ts``, as it would under TorchServe.

Body: JSON list of 4 numbers. Output per request: ``{label: probability}`` for the 3 classes, labels
from index_to_name.json (BaseHandler loads it into ``self.mapping``).
"""

import json

import torch
import torch.nn.functional as F

from ts.torch_handler.base_handler import BaseHandler
from ts.utils.util import PredictionException, map_class_to_label


class TinyClassifierHandler(BaseHandler):
    def preprocess(self, data):
        rows = []
        for row in data:
            body = row.get("data") or row.get("body")
            if isinstance(body, (bytes, bytearray)):
                body = json.loads(body.decode("utf-8"))
            if not isinstance(body, list) or len(body) != 4:
                raise PredictionException("expected a JSON list of 4 numbers", 400)
            rows.append(torch.tensor(body, dtype=torch.float32))
        return torch.stack(rows).to(self.device)

    def postprocess(self, data):
        probs = F.softmax(data, dim=1)
        for idx in range(len(probs)):
            self.context.set_response_header(idx, "x-model", self.context.model_name)
        return map_class_to_label(probs.tolist(), self.mapping)
