"""The serving benchmark (`epd bench`) and what the bench scripts share."""
