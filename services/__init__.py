"""EPD: encode/language disaggregated serving for vision-language models."""
