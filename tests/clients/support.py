"""What the client tests share: the served model's coordinates, the schemas the clients are asked for, and the
oracles their answers are checked against (kestrel's HTTP API read without any client, and transformers)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

import jsonschema
import pydantic
import transformers
from http_client import HTTP

HFModel = tuple[transformers.PreTrainedTokenizerBase, transformers.PreTrainedModel]


@dataclass(frozen=True)
class Served:
    """A running `kestrel serve`: where it listens, its key, the name it serves and the model directory behind it."""

    base_url: str
    api_key: str
    model: str
    model_dir: str

    @property
    def v1(self) -> str:
        return f"{self.base_url}/v1"

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """The server's own JSON answer, with no client library in between."""
        reply = HTTP.post(f"{self.v1}/{path}", json={"model": self.model, **body}, timeout=60,
                          headers={"Authorization": f"Bearer {self.api_key}"})
        assert reply.status_code == 200, reply.text
        return reply.json()


# Every field is bounded, so a random model finishes the object in a few tokens; `tag`, a string with a maxLength,
# is one a random model fills with any characters, control ones included, which must come out escaped for the
# clients' JSON parsers (kestrel.structured.json_strings). The docstring is short because langchain sends it as the
# tool's description.
class Pick(pydantic.BaseModel):
    """A pick."""

    colour: Literal["red", "green", "blue"]
    count: int = pydantic.Field(ge=0, le=99)
    sure: bool
    tag: str = pydantic.Field(max_length=6)


WEATHER_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
                   "unit": {"enum": ["c", "f"]}},
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": WEATHER_PARAMETERS}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_weather_call(name: str, arguments: str | dict[str, Any]) -> dict[str, Any]:
    """The call names get_weather and its arguments satisfy the tool's schema."""
    assert name == "get_weather"
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(args, WEATHER_PARAMETERS)
    return args
