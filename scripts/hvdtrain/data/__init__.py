"""Data: image data sets, rank sharding and samplers, BERT corpus preparation and
the pretraining shards. No Horovod here."""
