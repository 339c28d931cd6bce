"""kiln's own model code: one file per family on shared blocks, one registry in `auto`."""

from kiln.models.auto import (
                              REGISTRY,
                              AutoConfig,
                              AutoModel,
                              AutoModelForCausalLM,
                              AutoModelForImageClassification,
                              AutoModelForImageTextToText,
                              AutoModelForMaskedLM,
                              AutoModelForQuestionAnswering,
                              AutoModelForSequenceClassification,
                              AutoModelForTask,
                              AutoModelForTokenClassification,
                              load_pretrained,
)

__all__ = ["REGISTRY", "AutoConfig", "AutoModel", "AutoModelForCausalLM", "AutoModelForImageClassification",
           "AutoModelForImageTextToText", "AutoModelForMaskedLM", "AutoModelForQuestionAnswering",
           "AutoModelForSequenceClassification", "AutoModelForTask", "AutoModelForTokenClassification",
           "load_pretrained"]
