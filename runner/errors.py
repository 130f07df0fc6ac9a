"""The errors that mean "bad input": reported as one line and a non-zero exit, no traceback."""

from models.weights import WeightError
from runner.api.errors import AllFailedError, RequestFileError
from runner.checkpoints.source import SourceError
from runner.checkpoints.store import CheckpointError
from runner.settings import SettingsError
from runner.text.tokenizer import TokenizerError
from sharding.mesh import MeshError
from sharding.rules import RulesError

USER_ERRORS = (AllFailedError, CheckpointError, MeshError, RulesError, RequestFileError, SettingsError, SourceError,
               TokenizerError, WeightError)
